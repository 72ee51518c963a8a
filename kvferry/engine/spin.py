"""Keeping the event loop's CPU awake between requests.

On the virtual GPU hosts measured here a thread that sleeps a few milliseconds wakes on a cold CPU,
and the next request's work runs several times slower: resolving a block list on the GPU took
105 µs back to back and 342 µs after each 10 ms asleep, all of it CPU time
(``docs/decisions/005-busy-polling-after-activity.md``). So after any activity the loop
busy-polls for a while, as UCX's and NIXL's progress threads do, paying up to one core while
traffic flows. It stops while worker threads run: a spinning loop would hold the GIL they need.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Spinner:
    """Busy-polls the running event loop for ``window`` seconds after each ``touch`` (0: never)."""

    def __init__(self, window: float, on_spun: Callable[[float], None] = lambda seconds: None):
        self.window = window
        self._on_spun = on_spun
        self._until = 0.0
        self._workers = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start polling on the running loop (a no-op for a window of 0)."""
        if self.window > 0 and self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._spin(), name="kvferry-spin")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def touch(self) -> None:
        """Something happened: keep the loop hot for another window."""
        if self._wake is not None:
            self._until = time.monotonic() + self.window
            self._wake.set()

    async def in_thread(self, work: Callable[..., T], *args: Any) -> T:
        """``asyncio.to_thread`` without polling meanwhile (the worker needs the GIL). A caller
        cancelled meanwhile stops only once the work is over: a thread cannot be stopped, and
        what it reads or writes (a region, memory a peer lent) stays held until it ends."""
        self._workers += 1
        try:
            return await to_its_end(asyncio.ensure_future(asyncio.to_thread(work, *args)))
        finally:
            self._workers -= 1
            self.touch()

    async def _spin(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            started = time.monotonic()
            while self._workers == 0 and time.monotonic() < self._until:
                await asyncio.sleep(0)  # one loop iteration: ready callbacks, then a zero-timeout poll
            self._on_spun(time.monotonic() - started)


async def outlast(work: asyncio.Future) -> bool:
    """Wait for ``work`` to end, through the caller's own cancellation; True if the caller was
    cancelled meanwhile (it is to raise that once it has let go of what the work used)."""
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def to_its_end(work: asyncio.Future[T]) -> T:
    """``work``'s result, awaited to its end even if the caller is cancelled meanwhile (then
    raising the cancellation, once, after it): work that cannot be stopped (a worker thread, GPU
    kernels) keeps what it reads and writes held until it is over."""
    if await outlast(work):
        if not work.cancelled():
            work.exception()  # retrieved: nobody is left to take it
        raise asyncio.CancelledError
    return work.result()
