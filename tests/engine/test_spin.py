"""The engine's loop busy-polls for its window after activity, and not while a worker thread runs.

Measured as the loop thread's own CPU time on a real event loop: spinning burns it, waiting does not.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
import types

import pytest

from kvferry.engine.errors import PeerError
from kvferry.engine.spin import Mover, Spinner, current_cpu, nudge
from kvferry.engine.streaming import _unless_refused


async def _cpu_while(awaitable) -> float:
    """The loop thread's CPU seconds while ``awaitable`` runs on it."""
    started = time.thread_time()
    await awaitable
    return time.thread_time() - started


def test_touch_spins_for_the_window_then_rests():
    spun: list[float] = []

    async def main():
        spinner = Spinner(0.3, spun.append)
        spinner.start()
        resting = await _cpu_while(asyncio.sleep(0.3))  # not touched yet
        spinner.touch()
        hot = await _cpu_while(asyncio.sleep(0.3))
        after = await _cpu_while(asyncio.sleep(0.3))  # the window has passed
        await spinner.close()
        return resting, hot, after

    resting, hot, after = asyncio.run(main())
    assert resting < 0.05 and after < 0.05
    assert hot > 0.1  # most of the window's 0.3 s, less whatever the OS gave other processes
    assert len(spun) == 1 and 0.25 < spun[0] < 1.0


def test_a_worker_thread_pauses_spinning_and_its_end_resumes_it():
    async def main():
        spinner = Spinner(10.0)
        spinner.start()
        spinner.touch()
        await asyncio.sleep(0.05)
        during = await _cpu_while(spinner.in_thread(time.sleep, 0.3))
        resumed = await _cpu_while(asyncio.sleep(0.2))
        await spinner.close()
        return during, resumed

    during, resumed = asyncio.run(main())
    assert during < 0.05
    assert resumed > 0.05


def test_a_window_of_zero_never_spins():
    async def main():
        spinner = Spinner(0.0)
        spinner.start()
        spinner.touch()
        cpu = await _cpu_while(asyncio.sleep(0.2))
        assert await spinner.in_thread(sum, [1, 2]) == 3
        await spinner.close()
        return cpu

    assert asyncio.run(main()) < 0.05


def _unhandled(main) -> list[dict]:
    """Run ``main`` on a loop of its own; what that loop's exception handler was given (an error
    nobody retrieved, say)."""
    loop = asyncio.new_event_loop()
    unhandled: list[dict] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()
    return unhandled


def test_a_cancelled_caller_of_a_worker_thread_stops_only_once_the_work_is_over():
    """Cancelled twice while its thread runs, a caller raises its cancellation once the thread's
    work is over, not before; the work's own error is taken, never left unretrieved."""
    ended: list[str] = []

    def work():
        time.sleep(0.3)
        ended.append("work")
        raise ValueError("the work's own failure, nobody's to see")

    async def main():
        spinner = Spinner(0)
        caller = asyncio.ensure_future(spinner.in_thread(work))
        await asyncio.sleep(0.05)
        caller.cancel()
        await asyncio.sleep(0.05)
        caller.cancel()
        await asyncio.sleep(0.05)
        assert not caller.done()
        try:
            await caller
        except asyncio.CancelledError:
            ended.append("caller")
        assert ended == ["work", "caller"]

    assert not _unhandled(main())


def test_a_worker_threads_result_reaches_a_caller_that_was_not_cancelled():
    async def main():
        return await Spinner(0).in_thread(lambda x: x * 2, 21)

    assert asyncio.run(main()) == 42


def test_dropped_work_is_waited_for_and_its_own_error_taken():
    """A first chunk's encode dropped while it runs (here: work that, cancelled, still takes 0.2 s
    and then fails): ``dropped`` returns once it is over, and its error is never left unretrieved."""
    from kvferry.engine.streaming import dropped

    ended: list[str] = []

    async def work():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # GPU work it launched, finishing
            ended.append("work")
            raise ValueError("failed on its way out") from None

    async def main():
        running = asyncio.ensure_future(work())
        await asyncio.sleep(0.05)
        await dropped(running)
        ended.append("dropped")
        assert running.done()

    unhandled = _unhandled(main())
    assert ended == ["work", "dropped"] and not unhandled


def test_a_refusal_beside_a_failed_send_leaves_no_error_unretrieved():
    """The receiver's ERROR comes while a chunk's send is failing (its confirmation timed out), as
    when a stalled sender resumes: the peer's word is raised at once; the sends, asked to stop,
    end with their own error after all, which is taken, not left for the loop to report."""
    async def send():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            raise PeerError("chunk 2: receiver did not confirm within 3 s") from None

    async def main():
        loop = asyncio.get_running_loop()
        sends, reply = asyncio.gather(asyncio.ensure_future(send())), loop.create_future()
        await asyncio.sleep(0)
        reply.set_exception(PeerError("the receiver failed the transfer: no data for 3 s"))
        with pytest.raises(PeerError, match="the receiver failed"):
            await _unless_refused(types.SimpleNamespace(reply=reply), sends)
        await asyncio.sleep(0.01)
        assert sends.done() and not sends.cancelled()  # ended with the send's error (not retrieved here)
        del sends, reply  # the raised error's traceback holds the sends through its frame
        gc.collect()
        await asyncio.sleep(0)

    assert not _unhandled(main())


def test_a_transfer_ended_while_its_sends_run_leaves_no_error_unretrieved():
    """The transfer ends (its task cancelled: the peer was lost) while it waits on its sends, which
    its ``finally`` then cancels, as ``Chunks.stream`` does: their gathering ends with an error of
    its own (a child cancelled, not the gathering), taken, not left for the loop to report."""
    async def main():
        loop = asyncio.get_running_loop()
        children = [asyncio.ensure_future(asyncio.sleep(5)) for _ in range(3)]
        sends = asyncio.gather(*children)
        waiting = asyncio.ensure_future(_unless_refused(types.SimpleNamespace(reply=loop.create_future()), sends))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for child in children:
            child.cancel()
        await asyncio.sleep(0.01)
        assert sends.done() and not sends.cancelled()  # finished with a CancelledError of its own
        del sends, children, waiting
        gc.collect()
        await asyncio.sleep(0)

    assert not _unhandled(main())


# ---- moving off a slow CPU ---------------------------------------------------------------------
class _Host:
    """CPUs whose speed a test sets: what ``Mover`` measures, where it runs, and its moves."""

    def __init__(self, cpus: int, fast: float = 2e-6):
        self.speed = {cpu: fast for cpu in range(cpus)}
        self.at, self.moves = 0, []

    def measure(self) -> float:
        return self.speed[self.at]

    def where(self) -> int:
        return self.at

    def move(self, cpu: int, cpus: set[int]) -> None:
        assert cpus == set(self.speed)  # every CPU again after the move
        self.at = cpu
        self.moves.append(cpu)


def _mover(host: _Host, **kwargs):
    return Mover(list(host.speed), period=0.02, measure=host.measure, where=host.where, move=host.move,
                 learn=0, rng=random.Random(7), **kwargs)


def test_a_cpu_gone_slow_is_left_after_a_second_look_and_not_chosen_again_soon():
    host = _Host(8)
    moved: list[None] = []
    mover = _mover(host, on_move=lambda: moved.append(None))
    mover.turn(0.0)
    assert host.moves == [] and mover.best == 2e-6
    mover.turn(0.01)  # not due: nothing measured, nothing moved
    host.speed[0] = 4.4e-6  # CPU 0 runs at half speed
    mover.turn(0.02)
    assert host.moves == []  # once may be an interrupt
    mover.turn(0.021)
    assert len(host.moves) == 1 and host.at != 0 and len(moved) == 1
    first = host.at
    host.speed[first] = 4.4e-6  # the next one goes slow as well: neither is chosen for a while
    for now in (0.05, 0.051):
        mover.turn(now)
    assert host.at not in (0, first) and mover.moves == 2
    mover.turn(0.06)  # fast where it is now: it stays
    assert mover.moves == 2


def test_a_fast_cpu_is_never_left():
    host = _Host(4)
    mover = _mover(host)
    for i in range(200):
        mover.turn(i * 0.02)
    assert host.moves == [] and host.at == 0


def test_where_every_cpu_is_slow_moves_thin_out_and_a_fast_one_ends_that():
    host = _Host(4)
    mover = _mover(host)
    mover.turn(0.0)
    for cpu in host.speed:
        host.speed[cpu] = 4.4e-6
    now, seen = 0.02, []
    while now < 10.0:
        mover.turn(now)
        seen.append(mover.moves)
        now += 0.001
    assert 6 <= mover.moves <= 16  # the period doubles up to a second, not one move per check
    host.speed[host.at] = 2e-6
    before = mover.moves
    for i in range(100):
        mover.turn(now + i * 0.02)
    assert mover.moves == before


def test_first_checks_move_on_to_learn_the_best_speed():
    host = _Host(8)
    host.speed[0] = 4.4e-6  # the CPU it starts on is slow: alone, it would take that for the best
    mover = Mover(list(host.speed), period=0.02, measure=host.measure, where=host.where, move=host.move,
                  learn=4, rng=random.Random(3))
    for i in range(4):
        mover.turn(i * 0.02)
    assert mover.moves == 4 and mover.best == 2e-6


def test_the_thread_runs_where_it_was_moved_and_keeps_every_cpu():
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            assert current_cpu() == cpu
        nudge(min(allowed), allowed)
        assert os.sched_getaffinity(0) == allowed and current_cpu() in allowed
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_spinning_loop_turns_its_mover_and_a_resting_one_does_not():
    turns: list[float] = []

    class Counting:
        def turn(self, now: float) -> None:
            turns.append(now)

    async def main():
        spinner = Spinner(0.1, mover=Counting())  # type: ignore[arg-type]
        spinner.start()
        await asyncio.sleep(0.1)
        resting = len(turns)
        spinner.touch()
        await asyncio.sleep(0.15)
        spun = len(turns)
        await asyncio.sleep(0.1)
        await spinner.close()
        return resting, spun, len(turns)

    resting, spun, after = asyncio.run(main())
    assert resting == 0 and spun > 100 and after == spun
    assert turns == sorted(turns)


def test_a_move_the_kernel_refuses_takes_the_cpus_it_allows_now():
    host = _Host(4)

    def refused(cpu: int, cpus: set[int]) -> None:
        raise OSError(22, "Invalid argument")

    mover = _mover(host)
    mover._move = refused
    mover.turn(0.0)
    host.speed[0] = 4.4e-6
    mover.turn(0.02)
    mover.turn(0.021)
    assert mover.cpus == sorted(os.sched_getaffinity(0)) and mover.moves == 0


def test_a_mover_that_fails_is_dropped_and_the_loop_spins_on(caplog):
    class Broken:
        def turn(self, now: float) -> None:
            raise RuntimeError("broken")

    spun: list[float] = []

    async def main():
        spinner = Spinner(0.2, spun.append, mover=Broken())  # type: ignore[arg-type]
        spinner.start()
        spinner.touch()
        await asyncio.sleep(0.35)
        await spinner.close()
        return spinner.mover

    # Its whole window spun (seconds of the loop's own clock: the CPU share a busy host gives the
    # loop thread is not what is tested).
    assert asyncio.run(main()) is None and len(spun) == 1 and spun[0] >= 0.19
    assert "stops moving off slow CPUs" in caplog.text
