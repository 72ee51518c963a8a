"""The transfer table: its bounds in all, per direction and per peer, and its history (no daemon
needed; the state machine's own tests are ``test_states.py``)."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.engine.errors import Conflict, Overloaded
from kvferry.engine.states import Phase
from kvferry.engine.transfers import State, Transfer, TransferTable, peer_source


def _transfer(i: int, direction: str = "out", peer: str = "x:1") -> Transfer:
    return Transfer(id=f"t{i}", direction=direction, peer=peer, pairs=[("a", "b")], blocks=1, codec="raw",
                    source=peer_source(peer, i) if direction == "in" else "")


def _finish(table: TransferTable, t: Transfer, state: State = State.DONE) -> None:
    t.enter(Phase(state.value))
    table.retire(t)


def test_a_terminal_phase_is_recorded_once():
    async def main():
        t = _transfer(0)
        t.enter(Phase.CONNECTING)
        assert t.state == State.RUNNING
        t.enter(Phase.DONE)
        assert t.state == State.DONE and "done" in t.stages and await t.wait(0)

    asyncio.run(main())


def test_one_peer_cannot_take_every_incoming_slot():
    async def main():
        table = TransferTable(max_active=8, max_incoming=8, max_incoming_per_peer=2)
        flood = [table.add(_transfer(i, "in", "10.0.0.1:5000")) for i in range(2)]
        with pytest.raises(Overloaded, match="max_incoming_transfers_per_peer"):
            table.add(_transfer(2, "in", "10.0.0.1:5001"))  # another connection from the same address
        other = table.add(_transfer(3, "in", "10.0.0.2:5000"))
        _finish(table, flood[0])
        table.add(_transfer(4, "in", "10.0.0.1:5000"))  # its slot is free again
        assert peer_source("ucx-peer", 7) == "connection 7" and peer_source("[::1]:80", 1) == "::1"
        assert other.state == State.QUEUED

    asyncio.run(main())


def test_limits_and_history():
    async def main():
        table = TransferTable(max_active=2, history=3)
        a, b = table.add(_transfer(0)), table.add(_transfer(1))
        with pytest.raises(Overloaded):
            table.add(_transfer(2))
        with pytest.raises(Conflict):
            table.add(_transfer(0))
        for t in (a, b):
            _finish(table, t)
        for i in range(3, 12):
            _finish(table, table.add(_transfer(i)), State.CANCELLED)
        assert len(table.all()) == 3  # only the history is kept
        assert table.get("t11").state == State.CANCELLED
        assert [t.id for t in table.query()] == ["t11", "t10", "t9"]

    asyncio.run(main())


def test_a_transfer_can_be_awaited_before_it_arrives():
    """A decode waits on its own sidecar for a transfer a prefill is about to announce: the wait
    ends when it is added, or empty after its timeout, and leaves no waiter behind either way."""
    async def main():
        table = TransferTable(max_active=8, max_incoming=8)
        waiting = asyncio.ensure_future(table.arrival("t5", 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        added = table.add(_transfer(5, "in"))
        assert await waiting is added
        assert await table.arrival("t5", 0) is added  # here already
        assert await table.arrival("t6", 0.05) is None
        assert table._arrivals == {}
        many = [asyncio.ensure_future(table.arrival("t7", 5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        many[0].cancel()
        table.add(_transfer(7, "in"))
        assert [await w for w in many[1:]] == [table.get("t7")] * 2 and table._arrivals == {}

    asyncio.run(main())
