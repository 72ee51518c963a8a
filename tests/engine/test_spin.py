"""The engine's loop busy-polls for its window after activity, and not while a worker thread runs.

Measured as the loop thread's own CPU time on a real event loop: spinning burns it, waiting does not.
"""

from __future__ import annotations

import asyncio
import time

from kvferry.engine.spin import Spinner


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
