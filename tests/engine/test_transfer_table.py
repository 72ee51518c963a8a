"""The transfer state machine and table (no daemon needed)."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.engine.errors import Conflict, Overloaded
from kvferry.engine.transfers import State, Transfer, TransferTable


def _transfer(i: int) -> Transfer:
    return Transfer(id=f"t{i}", direction="out", src_region="a", src_blocks=[0], dst_region="b", dst_blocks=[0],
                    peer="http://x:1", codec="raw")


def test_legal_transitions_only():
    async def main():
        t = _transfer(0)
        assert t.move(State.RUNNING) and t.move(State.DONE)
        assert not t.move(State.FAILED)  # terminal states stay put
        fresh = _transfer(1)
        with pytest.raises(ValueError):
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
            t.move(State.RUNNING)
            t.move(State.DONE)
        for i in range(3, 12):
            t = table.add(_transfer(i))
            t.move(State.CANCELLED)
        assert len(table.all()) <= 5  # history + max_active
        assert table.get("t11").state == State.CANCELLED

    asyncio.run(main())
