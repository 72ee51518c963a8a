"""Keeping the event loop's CPU awake between requests, and on a CPU that runs it at full speed.

On the virtual GPU hosts measured here a thread that sleeps a few milliseconds wakes on a cold CPU,
and the next request's work runs several times slower: resolving a block list on the GPU took
105 µs back to back and 342 µs after each 10 ms asleep, all of it CPU time
(``docs/decisions/005-busy-polling-after-activity.md``). So after any activity the loop
busy-polls for a while, as UCX's and NIXL's progress threads do, paying up to one core while
traffic flows. It stops while worker threads run: a spinning loop would hold the GIL they need.
While it spins, a ``Mover`` keeps it off CPUs that have gone slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvferry.engine")

MIN_CPUS = 4  # a loop with fewer CPUs to go to stays where the kernel puts it


def plain_python_seconds() -> float:
    """The best of three runs of a fixed loop of plain Python (100 additions): how fast this CPU
    runs the interpreter now, in seconds (~2 µs on an idle H200 host's CPU)."""
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(100):
            total += i
        best = min(best, time.perf_counter() - started)
    return best


def current_cpu() -> int | None:
    """The CPU the calling thread runs on (Linux), or None where that is not known."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[36])  # field 39 of proc(5), counted after the command's closing parenthesis
    except (OSError, IndexError, ValueError):
        return None


def nudge(cpu: int, cpus: set[int]) -> None:
    """Move the calling thread to ``cpu``, then let it run on all of ``cpus`` again: a busy thread
    stays where it was moved, the kernel can still move it off a CPU it must share, and threads it
    starts later inherit every CPU, not one."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setaffinity(0, cpus)


class Mover:
    """Moves the busy-polling loop's thread off a CPU that runs it slowly.

    On the virtual GPU hosts measured here each CPU alternates, for seconds at a time, between two
    speeds about 2x apart (100 additions: ~2.3 and ~4.4 µs), each CPU on its own and with no steal
    time or load of the guest's own: most likely a hyperthread sibling the hypervisor does not
    show, busy for another guest. A one-block write between two sidecars follows its loops' CPUs
    (0.29-0.50 ms back to back on one host; ``docs/decisions/054-the-loop-moves-off-a-slow-cpu.md``).
    So every ``period`` while the loop spins it times ``plain_python_seconds``; found slower than
    ``SLOW`` times the best it has seen, twice running (once may be an interrupt), it moves to a CPU
    not found slow within ``memory`` seconds, chosen at random (two sidecars rarely pick the same).
    Its first checks each move on, to learn the best from several CPUs. Where every CPU is slow,
    moving does not help: each move onto a slow CPU doubles the period (up to ``longest``), and a
    fast check brings it back.
    """

    SLOW = 1.6  # slow periods measured 1.7-2.0x the fast speed

    def __init__(self, cpus: Sequence[int], period: float = 0.02, memory: float = 2.0, longest: float = 1.0,
                 measure: Callable[[], float] = plain_python_seconds, where: Callable[[], int | None] = current_cpu,
                 move: Callable[[int, set[int]], None] = nudge, on_move: Callable[[], None] = lambda: None,
                 learn: int = 4, rng: random.Random | None = None):
        self.cpus = sorted(set(cpus))
        self._period = self._now_period = period
        self._soon = min(period, 0.001)  # a second look, or the first at a CPU just moved to
        self._memory, self._longest = memory, longest
        self._measure, self._where, self._move, self._on_move = measure, where, move, on_move
        self._learning = learn
        self._rng = rng or random.Random()
        self.best = math.inf
        self._due = 0.0
        self._suspect = False
        self._moved = False  # the last move's CPU is not checked yet
        self._slow_at: dict[int, float] = {}  # CPU -> when it was last found slow
        self.moves = 0

    def turn(self, now: float) -> None:
        """One turn of the spinning loop (``now``: ``time.monotonic()``): a check, when one is due."""
        if now < self._due:
            return
        took = self._measure()
        self.best = min(self.best, took)
        slow = took > self.SLOW * self.best
        if self._learning > 0:
            self._learning -= 1
            self._go(now, self._where())
            return
        if not slow:
            self._suspect = self._moved = False
            self._now_period = self._period
            self._due = now + self._period
            return
        if self._moved:  # moved onto a slow CPU: every CPU may be slow now
            self._now_period = min(2 * self._now_period, self._longest)
        elif not self._suspect:
            self._suspect = True
            self._due = now + self._soon
            return
        self._suspect = False
        here = self._where()
        if here is not None:
            self._slow_at[here] = now
        self._go(now, here)

    def _go(self, now: float, here: int | None) -> None:
        fresh = [c for c in self.cpus if c != here and now - self._slow_at.get(c, -math.inf) > self._memory]
        choice = self._rng.choice(fresh or [c for c in self.cpus if c != here] or self.cpus)
        try:
            self._move(choice, set(self.cpus))
        except OSError:  # the CPUs it may use changed under it (a cpuset made smaller): move among those
            self.cpus = sorted(os.sched_getaffinity(0))
            self._due = now + self._period
            return
        self.moves += 1
        self._on_move()
        self._moved = True
        # The new CPU is checked at once, unless moving keeps finding slow ones.
        self._due = now + (self._now_period if self._now_period > self._period else self._soon)


class Spinner:
    """Busy-polls the running event loop for ``window`` seconds after each ``touch`` (0: never)."""

    def __init__(self, window: float, on_spun: Callable[[float], None] = lambda seconds: None,
                 mover: Mover | None = None):
        self.window = window
        self._on_spun = on_spun
        self.mover = mover
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
            started = now = time.monotonic()
            while self._workers == 0 and now < self._until:
                await asyncio.sleep(0)  # one loop iteration: ready callbacks, then a zero-timeout poll
                now = time.monotonic()
                if self.mover is not None:
                    try:
                        self.mover.turn(now)
                    except Exception:  # moving is an optimisation: the loop spins on without it
                        log.exception("the event loop stops moving off slow CPUs")
                        self.mover = None
            self._on_spun(now - started)


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
