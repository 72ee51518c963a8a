"""Real loopback transfers on both backends: bulk, interleaved, rejected, cancelled, refused."""

from __future__ import annotations

import asyncio
import hashlib
import socket

import numpy as np
import pytest

from kvferry import transport
from tests.transport.conftest import config, run


async def _pair(backend: str, **overrides):
    cfg = config(backend, **overrides)
    listener = await transport.listen("127.0.0.1", 0, cfg)
    connection = await transport.connect("127.0.0.1", listener.port, cfg)
    return cfg, listener, connection


@pytest.mark.slow
def test_one_gib_in_many_frames_arrives_bit_exact(backend):
    frame_bytes, frames = 16 << 20, 64  # 1 GiB in all, four transfers in flight at a time

    async def main():
        cfg, listener, connection = await _pair(backend, chunk_bytes=4 << 20, max_inflight_bytes=32 << 20)
        rng = np.random.default_rng(0)
        sent, received = hashlib.sha256(), hashlib.sha256()
        slots = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            async with slots:
                payload = rng.integers(0, 256, frame_bytes, dtype=np.uint8)
                sent.update(i.to_bytes(4, "little") + hashlib.sha256(payload).digest())
                buffer = np.empty(frame_bytes, dtype=np.uint8)
                receive = listener.expect(i, buffer)
                await asyncio.gather(connection.send(i, payload), receive.wait(cfg.op_timeout))
                digests[i] = hashlib.sha256(buffer).digest()

        digests: dict[int, bytes] = {}
        await asyncio.gather(*(one(i) for i in range(frames)))
        for i in range(frames):
            received.update(i.to_bytes(4, "little") + digests[i])
        assert sent.hexdigest() == received.hexdigest()
        await connection.close()
        await listener.close()

    run(main(), timeout=300)


@pytest.mark.parametrize("mode", transport.UCX_PROGRESS_MODES)
def test_every_ucx_progress_mode_moves_messages_and_data(mode):
    """ucxx is set up anew per process run (``run`` shuts it down): each mode really serves."""
    pytest.importorskip("ucxx")
    with pytest.raises(ValueError, match="ucx_progress_mode"):
        config("ucxx", ucx_progress_mode="spin")

    async def main():
        cfg, listener, connection = await _pair("ucxx", ucx_progress_mode=mode)
        for tag, n in enumerate((0, 3, 1 << 20, (3 << 20) + 5)):
            payload = np.random.default_rng(tag).integers(0, 256, n, dtype=np.uint8)
            buffer = np.empty(n, dtype=np.uint8)
            receive = listener.expect(tag, buffer)
            await asyncio.gather(connection.send(tag, payload), receive.wait(cfg.op_timeout))
            assert buffer.tobytes() == payload.tobytes()
        await connection.close()
        await listener.close()

    run(main())


def test_interleaved_transfers_share_one_connection(backend):
    async def main():
        cfg, listener, connection = await _pair(backend, chunk_bytes=64 << 10, max_inflight_bytes=256 << 10)
        sizes = [0, 1, 1000, 65536, 65537, 3 << 20]
        payloads = {tag: np.random.default_rng(tag).integers(0, 256, n, dtype=np.uint8).tobytes()
                    for tag, n in enumerate(sizes)}
        buffers = {tag: bytearray(len(p)) for tag, p in payloads.items()}
        receives = [listener.expect(tag, buffers[tag]) for tag in payloads]
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, connection._window.used)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(connection.send(tag, p) for tag, p in payloads.items()),
                             *(r.wait(cfg.op_timeout) for r in receives))
        watcher.cancel()
        assert all(bytes(buffers[tag]) == payloads[tag] for tag in payloads)
        assert 0 < peak <= cfg.max_inflight_bytes  # the window bounded what was in flight
        await connection.close()
        await listener.close()

    run(main())


def test_send_before_receive_is_posted(backend):
    async def main():
        cfg, listener, connection = await _pair(backend)
        send = asyncio.create_task(connection.send(5, b"early bird"))
        await asyncio.sleep(0.2)
        buffer = bytearray(10)
        assert await listener.expect(5, buffer).wait(cfg.op_timeout) == 10
        await send
        assert buffer == b"early bird"
        await connection.close()
        await listener.close()

    run(main())


def test_too_small_buffer_is_rejected_and_connection_survives(backend):
    async def main():
        cfg, listener, connection = await _pair(backend)
        small = listener.expect(1, bytearray(4))
        with pytest.raises(transport.TransferRejected, match="does not fit"):
            await connection.send(1, b"0123456789")
        with pytest.raises(transport.TransferRejected):
            await small.wait(1)
        buffer = bytearray(3)
        receive = listener.expect(2, buffer)
        await connection.send(2, b"abc")
        assert await receive.wait(1) == 3 and buffer == b"abc"
        await connection.close()
        await listener.close()

    run(main())


def test_unclaimed_transfer_times_out(backend):
    async def main():
        _, listener, connection = await _pair(backend)
        with pytest.raises(transport.TransportTimeout):
            await connection.send(9, b"nobody waits for this", timeout=0.5)
        await connection.close()
        await listener.close()

    run(main())


def test_cancelled_receive_rejects_the_sender(backend):
    async def main():
        cfg, listener, connection = await _pair(backend, chunk_bytes=64 << 10, max_inflight_bytes=128 << 10)
        receive = listener.expect(3, bytearray(8 << 20))
        send = asyncio.create_task(connection.send(3, bytes(8 << 20)))
        while receive.received == 0:
            await asyncio.sleep(0.001)
        receive.cancel()
        with pytest.raises(transport.TransferRejected, match="cancelled"):
            await send
        buffer = bytearray(2)
        follow = listener.expect(4, buffer)
        await connection.send(4, b"ok")
        assert await follow.wait(2) == 2
        await connection.close()
        await listener.close()

    run(main())


def test_connection_refused_is_a_clear_error(backend):
    async def main():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with pytest.raises(transport.ConnectError, match=str(port)):
            await transport.connect("127.0.0.1", port, config(backend, connect_timeout=1.0))

    run(main())


def test_listener_restarts_on_the_same_port(backend):
    async def main():
        cfg = config(backend)
        first = await transport.listen("127.0.0.1", 0, cfg)
        port = first.port
        connection = await transport.connect("127.0.0.1", port, cfg)
        receive = first.expect(1, bytearray(1))
        await connection.send(1, b"a")
        await receive.wait(2)
        await connection.close()
        await first.close()
        await asyncio.sleep(0.2)
        second = await transport.listen("127.0.0.1", port, cfg)
        assert second.port == port
        connection = await transport.connect("127.0.0.1", port, cfg)
        buffer = bytearray(1)
        receive = second.expect(2, buffer)
        await connection.send(2, b"b")
        assert await receive.wait(2) == 1 and buffer == b"b"
        await connection.close()
        await second.close()

    run(main())


def test_pool_reuses_and_reconnects(backend):
    async def main():
        cfg = config(backend)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        pool = transport.Pool(cfg)
        first = await pool.get("127.0.0.1", listener.port)
        assert await pool.get("127.0.0.1", listener.port) is first
        await first.close()
        second = await pool.get("127.0.0.1", listener.port)
        assert second is not first and not second.closed
        receive = listener.expect(1, bytearray(2))
        await second.send(1, b"hi")
        await receive.wait(2)
        await pool.close()
        await listener.close()

    run(main())


def test_garbage_from_a_peer_drops_only_that_connection():
    async def main():
        cfg = config("tcp")
        listener = await transport.listen("127.0.0.1", 0, cfg)
        loop = asyncio.get_running_loop()
        rogue = socket.create_connection(("127.0.0.1", listener.port))
        await loop.sock_sendall(rogue, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(48))
        rogue.setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(rogue, 10), 5) == b""  # dropped
        rogue.close()
        connection = await transport.connect("127.0.0.1", listener.port, cfg)
        receive = listener.expect(1, bytearray(3))
        await connection.send(1, b"yes")
        assert await receive.wait(2) == 3
        await connection.close()
        await listener.close()

    run(main())


def _paced_seconds(rate: float, payload_bytes: int, chunk_bytes: int) -> float:
    """Seconds one paced TCP transfer of ``payload_bytes`` takes, send to last byte received."""
    async def main():
        cfg, listener, connection = await _pair("tcp", chunk_bytes=chunk_bytes, max_inflight_bytes=8 * chunk_bytes,
                                                pace_bytes_per_s=rate)
        receive = listener.expect(1, bytearray(payload_bytes))
        started = asyncio.get_running_loop().time()
        await asyncio.gather(connection.send(1, bytes(payload_bytes)), receive.wait(cfg.op_timeout))
        elapsed = asyncio.get_running_loop().time() - started
        await connection.close()
        await listener.close()
        return elapsed

    return run(main())


def test_pacing_delays_even_a_one_message_transfer():
    rate, size = 100e6, 4 << 20  # one DATA message: a link of that rate needs 42 ms for it
    assert _paced_seconds(rate, size, chunk_bytes=16 << 20) >= size / rate


def test_pacing_emulates_a_slower_link():
    rate, size = 200e6, 64 << 20  # 200 MB/s: far below loopback, so the pacer sets the pace
    elapsed = _paced_seconds(rate, size, chunk_bytes=1 << 20)
    assert 0.9 * size / rate <= elapsed <= 3.0 * size / rate  # slack for a loaded CI box
