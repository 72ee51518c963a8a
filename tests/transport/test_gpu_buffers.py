"""CUDA buffers as sources and destinations on both backends: UCX moves device memory itself,
TCP stages it through the host. Skipped without a CUDA device."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kvferry import transport
from tests.transport.conftest import config, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("size", [1, 4096, 3 << 20, 40 << 20])
def test_cuda_to_cuda_bit_exact(backend, size):
    async def main():
        cfg = config(backend, chunk_bytes=16 << 20, max_inflight_bytes=64 << 20)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        connection = await transport.connect("127.0.0.1", listener.port, cfg)
        generator = torch.Generator(device="cuda").manual_seed(size)
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=generator)
        target = torch.zeros(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        receive = listener.expect(7, target)
        await connection.send(7, payload)
        await receive.wait(cfg.op_timeout)
        torch.cuda.synchronize()
        assert torch.equal(target, payload)
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("size", [9 << 20 | 13, 40 << 20])
@pytest.mark.parametrize("src, dst", [("cuda", "cpu"), ("cpu", "cuda")])
def test_between_host_and_device_bit_exact(backend, size, src, dst):
    """One side's payload on the GPU, the other's in host memory: the digest of a device payload
    is checked on the CPU, a host payload's tag before it reaches the device."""
    async def main():
        cfg = config(backend, chunk_bytes=16 << 20, max_inflight_bytes=64 << 20)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        connection = await transport.connect("127.0.0.1", listener.port, cfg)
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).to(src)
        target = torch.zeros(size, dtype=torch.uint8, device=dst)
        torch.cuda.synchronize()
        receive = listener.expect(9, target)
        await connection.send(9, payload)
        await receive.wait(cfg.op_timeout)
        torch.cuda.synchronize()
        assert torch.equal(target.cpu(), payload.cpu())
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


@contextlib.asynccontextmanager
async def _damaging_link(flip_at: int):
    """A TCP listener and a connection to it through a relay that flips one bit of the byte at
    ``flip_at`` of what the connection sends, and a 12 MiB device payload with its zeroed target."""
    unflipped = [True]  # only the first connection the relay carries is damaged

    async def pipe(reader, writer, flip):
        seen = 0
        while data := await reader.read(1 << 20):
            if flip and seen <= flip_at < seen + len(data):
                data = bytearray(data)
                data[flip_at - seen] ^= 0x01
                flip = False
            seen += len(data)
            writer.write(bytes(data))
            await writer.drain()
        writer.close()

    async def handle(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", listener.port)
        flip, unflipped[0] = unflipped[0], False
        await asyncio.gather(pipe(reader, up_writer, flip), pipe(up_reader, writer, False), return_exceptions=True)

    cfg = config("tcp", chunk_bytes=16 << 20, max_inflight_bytes=64 << 20)
    listener = await transport.listen("127.0.0.1", 0, cfg)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    connection = await transport.connect("127.0.0.1", server.sockets[0].getsockname()[1], cfg)
    payload = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, device="cuda")
    try:
        yield cfg, listener, connection, payload, torch.zeros_like(payload)
    finally:
        await connection.close()
        await listener.close()
        server.close()


def test_a_device_payload_damaged_on_the_wire_fails_that_transfer_only():
    """A relay flips one byte of a staged device payload over TCP: its digest fails on the GPU,
    that transfer fails, and the next one on the same connection lands bit-exact."""
    async def main():
        # 6 MiB: inside the first payload, past the handshake
        async with _damaging_link(flip_at=6 << 20) as (cfg, listener, connection, payload, target):
            receive = listener.expect(1, target)
            with pytest.raises(transport.TransportError):
                await connection.send(1, payload)
            with pytest.raises(transport.CorruptPayload):
                await receive.wait(cfg.op_timeout)
            receive = listener.expect(2, target)
            await connection.send(2, payload)
            await receive.wait(cfg.op_timeout)
            torch.cuda.synchronize()
            assert torch.equal(target, payload)

    run(main(), timeout=60)


def test_a_deferred_device_digest_over_tcp_is_checked_after_the_bytes_land():
    """A streamed chunk's receive defers its check (``defer_check``): over TCP the damaged device
    payload lands unverified, the reader goes on, and the check launched afterwards
    (``start_check``, beside the decode) fails it; the next payload's check passes."""
    async def main():
        async with _damaging_link(flip_at=6 << 20) as (cfg, listener, connection, payload, target):
            receive = listener.expect(1, target, defer_check=True)
            await connection.send(1, payload)
            await receive.wait(cfg.op_timeout)
            verdict = receive.start_check()
            with pytest.raises(transport.CorruptPayload):
                verdict()
            receive = listener.expect(2, target, defer_check=True)
            await connection.send(2, payload)
            await receive.wait(cfg.op_timeout)
            receive.start_check()()
            torch.cuda.synchronize()
            assert torch.equal(target, payload)

    run(main(), timeout=60)
