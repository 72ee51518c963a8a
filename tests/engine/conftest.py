from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest

from kvferry.client import Client
from kvferry.demo import free_port, load_kv, start_sidecar, wait_ready
from kvferry.testing import faults
from tests.conftest import KV_SAMPLE

TOKEN = "test-token-123"


@dataclass
class Daemon:
    url: str
    client: Client
    process: subprocess.Popen
    data: str = ""  # the data address peers send to

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def spawn(backend: str = "tcp", env: dict | None = None, extra: list[str] | None = None, device: str = "cpu",
          corrupt_chunk: int | None = None) -> Daemon:
    """A sidecar process; ``corrupt_chunk``: one whose sender corrupts that chunk of every transfer
    (``kvferry.testing.faults.corrupt_chunk``)."""
    port, data_port = free_port(), free_port()
    entry = "kvferry.cli"
    if corrupt_chunk is not None:
        env, entry = {**(env or {}), faults.CORRUPT_CHUNK: str(corrupt_chunk)}, "kvferry.testing.serve"
    process = start_sidecar(port, data_port, backend, token=TOKEN, extra=extra, env=env, device=device, entry=entry)
    url = f"http://127.0.0.1:{port}"
    client = Client(url, token=TOKEN)
    wait_ready(client, process)
    return Daemon(url, client, process, client.data_address())


def stop(*daemons: Daemon) -> None:
    for daemon in daemons:
        daemon.client.close()
        daemon.process.terminate()
    for daemon in daemons:
        try:
            daemon.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.process.kill()


@pytest.fixture(scope="module", params=["tcp", "ucxx"])
def pair(request):
    """A prefill-side and a decode-side sidecar, real processes and ports."""
    # Paced at 0.2 GB/s so that a mid-transfer cancel has a transfer to cancel on a fast machine.
    env = {"KVFERRY_TRANSFER_TIMEOUT": "10", "KVFERRY_CHUNK_BYTES": str(1 << 20), "KVFERRY_EMULATED_LINK_GBPS": "0.2"}
    a, b = spawn(request.param, env), spawn(request.param, env)
    yield a, b
    stop(a, b)


@pytest.fixture(scope="session")
def kv():
    return load_kv(KV_SAMPLE)

