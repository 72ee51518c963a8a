"""Awaiting GPU work from the event loop. A stream or event synchronize would hold the whole loop
(UCX's progress, every other transfer's messages) for the GPU's time; polling once per turn of
the loop lets them run meanwhile."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from .errors import TransportTimeout


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
    deadline = time.monotonic() + timeout
    while not all(work.ready() for work in launched):
        if time.monotonic() > deadline:
            raise TransportTimeout(f"{what}: the GPU did not finish within {timeout:g} s")
        await asyncio.sleep(0)
