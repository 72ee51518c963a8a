"""CUDA buffers as sources and destinations on both backends: UCX moves device memory itself,
TCP stages it through the host. Skipped without a CUDA device."""

from __future__ import annotations

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
