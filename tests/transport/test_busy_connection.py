"""A receive granted on a connection waits its turn: while the connection lands other transfers'
bytes it is not stalled, however long its own first byte takes; a connection that lands too little
(below the waiter's floor) or nothing at all fails it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from kvferry import transport
from kvferry.transport.mailbox import Progress
from tests.transport.conftest import config, run

SIZE = 512 << 10  # per transfer: eight 64 KiB DATA messages


async def _queued(backend: str, rate: float, timeout: float, min_rate: float, tags: int = 4):
    """``tags`` transfers granted at once on one connection paced to ``rate`` bytes/s, sent one
    after the other; every receive waits from its grant with ``timeout`` and ``min_rate``.
    Returns what each wait gave (bytes or its error) and when it ended (seconds after its grant),
    the payloads and the buffers."""
    cfg = config(backend, chunk_bytes=64 << 10, pace_bytes_per_s=rate, op_timeout=1.0)
    payloads = {tag: np.random.default_rng(tag).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
                for tag in range(1, tags + 1)}
    waits: dict[int, asyncio.Future] = {}
    buffers: dict[int, bytearray] = {}
    took: dict[int, float] = {}

    def on_message(connection, payload):  # the layer above grants every transfer's buffer at once
        for tag in payloads:
            buffers[tag] = bytearray(SIZE)
            receive = connection.grant(tag, buffers[tag], tell=False)
            waits[tag] = asyncio.ensure_future(receive.wait(timeout, min_rate))
            waits[tag].add_done_callback(lambda _, tag=tag, granted=time.monotonic(): took.setdefault(
                tag, time.monotonic() - granted))

    listener = await transport.listen("127.0.0.1", 0, cfg, on_message=on_message)
    client = await transport.connect("127.0.0.1", listener.port, cfg)
    try:
        await client.send_message(b"go")
        for tag, payload in payloads.items():  # one at a time: the last one's bytes come last
            try:
                await client.send(tag, payload, clearance=transport.Clearance.INITIAL)
            except transport.TransportError:
                break  # refused: its receive failed
        results = await asyncio.gather(*waits.values(), return_exceptions=True)
    finally:
        await client.close()
        await listener.close()
    return dict(zip(waits, results)), took, payloads, buffers


def test_a_receive_behind_others_on_a_busy_connection_is_not_stalled(backend):
    # 2 MiB at 2 MB/s: the last transfer's first byte comes ~0.8 s after its grant, twice its 0.4 s.
    results, _, payloads, buffers = run(_queued(backend, rate=2e6, timeout=0.4, min_rate=1 << 20))
    assert results == {tag: SIZE for tag in payloads}, results
    assert all(bytes(buffers[tag]) == payloads[tag] for tag in payloads)


def test_a_connection_delivering_under_the_floor_fails_the_receives_it_carries(backend):
    # 1 MB/s (a message every 65 ms) against a floor of 8 MiB/s: past ~0.25 s every wait fails.
    results, took, _, _ = run(_queued(backend, rate=1e6, timeout=0.2, min_rate=8 << 20, tags=2))
    assert all(isinstance(r, transport.TransportTimeout) and "under the floor" in str(r) for r in results.values()), \
        results
    assert max(took.values()) < 0.5, took  # its own 512 KiB alone take the link 0.5 s


def test_a_granted_receive_with_nothing_landing_fails_in_its_timeout(backend):
    async def main():
        cfg = config(backend)
        waits = []

        def on_message(connection, payload):
            waits.append(asyncio.ensure_future(connection.grant(1, bytearray(16), tell=False).wait(0.3, 1 << 20)))

        listener = await transport.listen("127.0.0.1", 0, cfg, on_message=on_message)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        try:
            await client.send_message(b"go")  # then nothing: the connection stays open and silent
            while not waits:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            with pytest.raises(transport.TransportTimeout, match="no data for 0.3 s"):
                await waits[0]
            return time.monotonic() - started
        finally:
            await client.close()
            await listener.close()

    assert run(main()) < 0.3 + 1


def test_a_send_waiting_for_window_room_behind_others_waits_while_acknowledgements_come(backend):
    """Sixteen sends at once through a 256 KiB window over a connection paced to 1 MB/s: the last
    ones wait for room far longer than their 0.3 s timeout (a dozen 64 KiB messages ahead), while
    the receiver acknowledges the others' bytes all along, and are sent whole."""
    async def main():
        cfg = config(backend, chunk_bytes=64 << 10, max_inflight_bytes=256 << 10, pace_bytes_per_s=1e6,
                     op_timeout=0.3)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        payloads = {tag: np.random.default_rng(tag).integers(0, 256, 128 << 10, dtype=np.uint8).tobytes()
                    for tag in range(1, 17)}
        buffers = {tag: bytearray(128 << 10) for tag in payloads}
        receives = [listener.expect(tag, buffers[tag]) for tag in payloads]
        try:
            started = time.monotonic()
            await asyncio.gather(*(client.send(tag, p) for tag, p in payloads.items()),
                                 *(r.wait(cfg.op_timeout, 1 << 20) for r in receives))
            took = time.monotonic() - started
        finally:
            await client.close()
            await listener.close()
        assert all(bytes(buffers[tag]) == payloads[tag] for tag in payloads)
        return took

    assert run(main()) > 1.5  # 2 MiB at 1 MB/s


def test_a_receive_behind_a_payload_being_read_is_given_its_bytes_time_at_the_floor_and_no_more():
    """A 1 MiB payload is being read on the connection (its header came; a backend lands it only
    once whole): a receive waiting behind it with a 0.3 s timeout and a 2 MiB/s floor is given the
    payload's 0.5 s on top, and fails once that is past with nothing landed."""
    async def main():
        progress = Progress()
        receive = transport.Receive(1, bytearray(16), transport.Mailbox())
        receive.bind(progress)
        progress.begin(1 << 20)
        started = time.monotonic()
        with pytest.raises(transport.TransportTimeout, match="no data for 0.3 s"):
            await receive.wait(0.3, 2 << 20)
        return time.monotonic() - started

    took = run(main())
    assert 0.75 <= took < 0.8 + 1


class _SlowCable:
    """A TCP relay to ``port`` that carries the dialler's bytes at ``rate`` bytes/s (the other
    way at full speed): a slow link on loopback, a real socket at each end."""

    def __init__(self, port: int, rate: float):
        self.port, self.rate = port, rate

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(source, sink, rate: float) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while piece := await source.read(16 << 10):
                    sink.write(piece)
                    await sink.drain()
                    if rate:
                        await asyncio.sleep(len(piece) / rate)
            sink.close()

        await asyncio.gather(pump(reader, up_writer, self.rate), pump(up_reader, writer, 0))

    async def close(self) -> None:
        self._server.close()


def test_a_payload_dropped_as_it_slowly_comes_is_progress_for_the_receives_behind_it():
    """The receiver drops a 2 MiB payload it holds no receive for (a transfer it ended), which a
    1.5 MB/s link takes ~1.4 s to bring, over twice the 0.5 s timeout of the receive granted
    behind it (its floor, 512 KiB/s, gives the payload 4 s): that receive waits it out, and lands."""
    async def main():
        cfg = config("tcp", chunk_bytes=4 << 20, max_inflight_bytes=16 << 20, op_timeout=10.0)
        small = np.random.default_rng(2).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
        buffer = bytearray(len(small))
        waited: list[asyncio.Future] = []

        def on_message(connection, payload):  # the layer above grants transfer 2, not 1
            waited.append(asyncio.ensure_future(connection.grant(2, buffer, tell=False).wait(0.5, 512 << 10)))

        listener = await transport.listen("127.0.0.1", 0, cfg, on_message=on_message)
        cable = _SlowCable(listener.port, 1.5e6)
        client = await transport.connect("127.0.0.1", await cable.start(), cfg)
        try:
            await client.send_message(b"go")
            initial = transport.Clearance.INITIAL
            sent = await asyncio.gather(client.send(1, bytes(2 << 20), clearance=initial),
                                        client.send(2, small, clearance=initial), return_exceptions=True)
            assert isinstance(sent[0], transport.TransferRejected) and sent[1] is None, sent
            assert await waited[0] == len(small) and bytes(buffer) == small
        finally:
            await client.close()
            await listener.close()
            await cable.close()

    run(main())
