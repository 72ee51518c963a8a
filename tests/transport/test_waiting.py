"""``until_ready``: the event loop awaits GPU work by polling it, running other tasks meanwhile,
and gives up at a deadline."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.transport import TransportTimeout
from kvferry.transport.waiting import until_ready
from tests.conftest import LoopTurns


class _After:
    """Ready after ``polls`` questions."""

    def __init__(self, polls: int):
        self.polls = polls

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_other_tasks_run_while_it_waits():
    async def main():
        async with LoopTurns() as loop:
            await until_ready(_After(3), _After(20), timeout=5, what="test")
        return loop.turns

    assert asyncio.run(main()) >= 10


def test_ready_work_returns_without_yielding():
    async def main():
        order = []
        asyncio.get_running_loop().call_soon(order.append, "other")
        await until_ready(_After(0), timeout=5, what="test")
        order.append("done")
        return list(order)

    assert asyncio.run(main()) == ["done"]


def test_it_gives_up_at_its_deadline():
    async def main():
        await until_ready(_After(1 << 60), timeout=0.05, what="the work")

    with pytest.raises(TransportTimeout, match="the work"):
        asyncio.run(main())
