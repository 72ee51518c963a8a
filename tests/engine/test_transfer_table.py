"""The transfer state machine and table (no daemon needed)."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.engine.errors import Conflict, EngineError, Overloaded
from kvferry.engine.transfers import State, Transfer, TransferTable


def _transfer(i: int) -> Transfer:
    return Transfer(id=f"t{i}", direction="out", peer="x:1", pairs=[("a", "b")], blocks=1, codec="raw")


def _finish(table: TransferTable, t: Transfer, state: State = State.DONE) -> None:
    t.move(State.RUNNING)
    t.move(state)
    table.retire(t)


def test_legal_transitions_only():
    async def main():
        t = _transfer(0)
        assert t.move(State.RUNNING) and t.move(State.DONE)
        assert not t.move(State.FAILED)  # terminal states stay put
        assert "done" in t.stages
        fresh = _transfer(1)
        with pytest.raises(EngineError):
            fresh.move(State.DONE)  # queued -> done skips running

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
