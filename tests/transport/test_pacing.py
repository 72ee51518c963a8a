"""The link emulator's pacer: a message's write ends when a link of the set rate would have
delivered its last byte; the sender's own write time (the loopback copy) is the link's
serialization, not added to it; the emulation never runs faster than the link."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.transport import flow


class _Clock:
    """A monotonic clock the test moves: sleeping advances it by exactly the time asked for."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += max(0.0, seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(flow.time, "monotonic", c.monotonic)
    monkeypatch.setattr(flow.asyncio, "sleep", c.sleep)
    return c


def test_each_message_waits_for_its_serialization(clock: _Clock) -> None:
    pacer = flow.Pacer(1000.0)  # bytes per second
    asyncio.run(pacer.admit(500))
    asyncio.run(pacer.admit(500))
    assert clock.slept == pytest.approx([0.5, 0.5])


def test_write_time_overlaps_the_serialization(clock: _Clock) -> None:
    pacer = flow.Pacer(1000.0)
    asyncio.run(pacer.admit(500))  # nothing measured yet: waits the whole serialization
    clock.now += 0.2  # the loopback write of the first message: 2,500 B/s
    pacer.wrote(500, 0.2)
    asyncio.run(pacer.admit(500))
    # The link was idle while the first message was written (0.5-0.7); it delivers the second's
    # last byte at 1.2, so the second's 0.2 s write starts at 1.0 and ends then.
    assert clock.now == pytest.approx(100.0 + 1.0)
    clock.now += 0.2
    pacer.wrote(500, 0.2)
    asyncio.run(pacer.admit(500))
    assert clock.now == pytest.approx(100.0 + 1.5)  # the third ends at 1.7: no time is added per message
    clock.now += 0.4  # a slower write (ends at 1.9, after the link's 1.7) does not lengthen the lead,
    pacer.wrote(500, 0.4)  # which would start later writes so early that they end before the link
    asyncio.run(pacer.admit(500))
    assert clock.now == pytest.approx(100.0 + 2.2)  # the link is free at 1.9 and delivers it at 2.4


def test_an_idle_sender_leaves_the_link_idle(clock: _Clock) -> None:
    pacer = flow.Pacer(1000.0)
    asyncio.run(pacer.admit(500))
    clock.now += 2.0  # nothing to send for two seconds (not writing)
    asyncio.run(pacer.admit(500))
    assert clock.slept[-1] == pytest.approx(0.5)
