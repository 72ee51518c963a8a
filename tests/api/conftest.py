"""Sidecars serving both front ends: REST and gRPC on their own ports, real processes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvferry.client import AsyncClient
from kvferry.demo import free_port
from tests.engine.conftest import TOKEN, Daemon, spawn, stop

pytest.importorskip("grpc", reason="the gRPC control plane needs the grpc extra (pip install kvferry[grpc])")

# Slow enough that a transfer of a few MiB is still running when a test cancels or watches it.
SLOW_LINK = {"KVFERRY_TRANSFER_TIMEOUT": "10", "KVFERRY_CHUNK_BYTES": str(256 << 10),
             "KVFERRY_EMULATED_LINK_GBPS": "0.01"}


@dataclass
class Sidecar:
    daemon: Daemon
    grpc: str  # host:port of its gRPC control plane

    @property
    def data(self) -> str:
        return self.daemon.data

    def client(self, front: str, token: str | None = TOKEN):
        """An asyncio client of this sidecar over ``front`` (rest or grpc); make it inside the loop."""
        if front == "rest":
            return AsyncClient(self.daemon.url, token=token)
        from kvferry.client.grpc import GrpcClient

        return GrpcClient(self.grpc, token=token)


def spawn_sidecar(env: dict | None = None, grpc_port: int | None = None) -> Sidecar:
    port = grpc_port or free_port()
    daemon = spawn("tcp", {**SLOW_LINK, **(env or {})}, extra=["--grpc-port", str(port)])
    return Sidecar(daemon, f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def sidecars():
    """A sending and a receiving sidecar, each serving REST and gRPC."""
    a, b = spawn_sidecar(), spawn_sidecar()
    yield a, b
    stop(a.daemon, b.daemon)


@pytest.fixture(params=["rest", "grpc"])
def front(request) -> str:
    return request.param
