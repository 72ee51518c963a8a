from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvferry import transport
from kvferry.transport import lanes

# UCX over TCP, plus its CUDA transports where there is a GPU (set before ucxx initializes; the
# transport never reads the environment).
os.environ.setdefault("UCX_TLS", "tcp,cuda_copy,cuda_ipc" if torch.cuda.is_available() else "tcp")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# "tcp-lanes": TCP links of three sockets, every DATA payload of 64 KiB or more spread over them.
# "tcp-unix": the tcp backend between two ends of one host, over the listener's Unix socket.
BACKENDS = ["tcp", "tcp-lanes", "tcp-unix", "ucxx"]


def config(backend: str, **overrides) -> transport.TransportConfig:
    settings = dict(backend=backend, chunk_bytes=1 << 20, max_inflight_bytes=8 << 20,
                    connect_timeout=3.0, op_timeout=5.0, close_timeout=2.0)
    if backend == "tcp-lanes":
        settings.update(backend="tcp", tcp_lanes=3)
    if backend == "tcp-unix":
        settings.update(backend="tcp", local_socket=True)
    settings.update(overrides)
    return transport.TransportConfig(**settings)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    if request.param == "tcp-lanes":
        monkeypatch.setattr(lanes, "STRIPE_MIN", 64 << 10)
    return request.param


def run(coro, timeout: float = 120.0):
    """Run a test coroutine with a hard ceiling, so a hang fails instead of stalling CI."""
    async def bounded():
        try:
            return await asyncio.wait_for(coro, timeout)
        finally:
            transport.shutdown_backends()

    return asyncio.run(bounded())
