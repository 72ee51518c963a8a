"""Awaiting GPU work from the event loop. A stream or event synchronize would hold the whole loop
(UCX's progress, every other transfer's messages) for the GPU's time; polling once per turn of
the loop lets them run meanwhile; a wait past ``SPIN_S`` polls every ``SLOW_POLL_S`` instead
(no longer latency-bound, and a peer's stalled event must not hold a core for its whole timeout)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from .errors import TransportTimeout

SPIN_S = 0.05
SLOW_POLL_S = 0.001  # the loop's own timer resolution


class Launched(Protocol):
    """GPU work launched on a stream (a CUDA event, a codec's pending result, a device CRC)."""

    def ready(self) -> bool: ...


async def until_ready(*launched: Launched, timeout: float, what: str) -> None:
    """Return once every one of ``launched`` is ready, yielding to the loop between polls.

    Raises:
        TransportTimeout: they were not all ready within ``timeout`` seconds.
    """
    if all(work.ready() for work in launched):
        return
    start = time.monotonic()
    deadline = start + timeout
    while not all(work.ready() for work in launched):
        now = time.monotonic()
        if now > deadline:
            raise TransportTimeout(f"{what}: the GPU did not finish within {timeout:g} s")
        await asyncio.sleep(0 if now - start < SPIN_S else SLOW_POLL_S)
