"""Timestamps of a leased write's steps in both sidecars, on one clock (``time.perf_counter_ns``,
the host's monotonic clock: the same in every process of a host).

Put this folder first on ``PYTHONPATH`` and name a folder in ``SIDECAR_TRACE_DIR`` (not a
``KVFERRY_`` name: the sidecars refuse settings they do not know); every ``kvferry ... serve``
process started then (the sidecars ``bench/peers.py`` and ``bench/latency.py`` start) wraps the
steps below and writes ``<pid>.json`` there when it exits. ``show.py`` lines the
two sidecars up by the sender's submits. Each wrapper costs well under a microsecond. A fixed
loop of 100 additions, timed as its own step before each submit and each admission, says what
plain Python cost in that process at that moment: beside its time alone, how much slower the CPU
ran the sidecar's code than the code itself asks.

    PYTHONPATH=bench/trace:$PYTHONPATH SIDECAR_TRACE_DIR=/tmp/trace \\
        python bench/peers.py --gpus 2 --backend tcp --sizes 2M --codecs raw --small-repeats 600 --no-nixl
    python bench/trace/show.py /tmp/trace
"""

import os
import sys

_DIR = os.environ.get("SIDECAR_TRACE_DIR")


def _install(folder: str) -> None:
    import atexit
    import functools
    import json
    import signal
    import time

    from kvferry.engine import dispatch, engine, incoming, outgoing, pipeline, samehost, transfers
    from kvferry.transport import connection, tcp

    events: list[tuple[str, int]] = []
    now = time.perf_counter_ns

    def dump(*_) -> None:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(events, f)

    atexit.register(dump)
    raise_signal = signal.raise_signal

    def dump_and_raise(sig) -> None:  # uvicorn raises SIGTERM again after its shutdown: atexit would not run
        dump()
        raise_signal(sig)

    signal.raise_signal = dump_and_raise

    def timed(step: str, call, *args, **kwargs):
        """``call``'s result, with ``step`` when it begins and ``step/`` when it returns."""
        events.append((step, now()))
        try:
            return call(*args, **kwargs)
        finally:
            events.append((step + "/", now()))

    def wrap(owner, name: str, step: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def traced(*args, **kwargs):  # a function, not a partial: bound as a method where it replaces one
            return timed(step, inner, *args, **kwargs)

        setattr(owner, name, traced)

    def wrap_awaited(owner, name: str, step: str) -> None:
        """``step`` when the awaited call returns."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        async def awaited(*args, **kwargs):
            result = await inner(*args, **kwargs)
            events.append((step, now()))
            return result

        setattr(owner, name, awaited)

    def additions() -> int:
        total = 0
        for i in range(100):
            total += i
        return total

    def calibrated(owner, name: str) -> None:
        """A fixed loop of 100 additions timed as a step before each call: what plain Python
        costs at that moment in this process (1.1 µs alone on an idle H200 host)."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def after_additions(*args, **kwargs):
            timed("100 additions", additions)
            return inner(*args, **kwargs)

        setattr(owner, name, after_additions)

    calibrated(engine.Engine, "submit")
    calibrated(incoming.Admission, "accept")
    wrap(engine.Engine, "submit", "submit")
    wrap(outgoing.Outgoing, "start_leased", "leased")
    wrap(pipeline.CodecRunner, "call_now", "copy and announce")
    wrap(samehost, "write_blocks", "write")
    outgoing.write_blocks = samehost.write_blocks
    wrap(outgoing.Outgoing, "_announce", "announce packed")
    wrap(connection.Connection, "post_message", "post")
    wrap_awaited(tcp.TcpLink, "recv_header", "header read")
    wrap(dispatch, "on_message", "peer message")  # before the engine binds it
    wrap(incoming.Admission, "accept", "admission")
    wrap(outgoing.Outgoing, "_replied", "replied")
    enter = transfers.Transfer.enter

    def entered(self, phase, *args, **kwargs):
        events.append(("enters " + phase.name, now()))
        return enter(self, phase, *args, **kwargs)

    transfers.Transfer.enter = entered


if _DIR and "serve" in sys.argv:
    _install(_DIR)
