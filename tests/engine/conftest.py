from __future__ import annotations

import itertools
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvferry.client import Client
from kvferry.demo import free_port, load_kv, start_sidecar, wait_ready
from kvferry.testing import faults
from tests.conftest import KV_SAMPLE

TOKEN = "test-token-123"
LOG_TAIL = 6000  # characters of a sidecar's log a failing test shows

# Where spawned sidecars write their logs (tests/conftest.py points it at pytest's temporary
# directory); spawn makes one of its own if nothing set it.
logs: Path | None = None
# Every sidecar spawned in this process, so that a failing test can show what they logged.
spawned: list[Daemon] = []
_numbers = itertools.count(1)


@dataclass
class Daemon:
    url: str
    client: Client
    process: subprocess.Popen
    data: str = ""  # the data address peers send to
    log: Path | None = None  # its stderr (the sidecar's log)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size if self.log is not None else 0
        except OSError:
            return 0

    def log_tail(self, since: int = 0, chars: int = LOG_TAIL) -> str:
        """The end of what the sidecar logged past byte ``since`` (at most ``chars`` characters)."""
        if self.log is None:
            return ""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(since, self.log_size() - 4 * chars))
                text = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read {self.log}: {exc})"
        return text[-chars:]


def log_path(port: int) -> Path:
    """A fresh log file for a sidecar on ``port`` (one restarted there gets another)."""
    global logs
    if logs is None:
        logs = Path(tempfile.mkdtemp(prefix="kvferry-sidecar-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"sidecar-{port}-{next(_numbers)}.log"


def spawn(backend: str = "tcp", env: dict | None = None, extra: list[str] | None = None, device: str = "cpu",
          corrupt_chunk: int | None = None) -> Daemon:
    """A sidecar process, its log in a file (``Daemon.log``; a pipe nobody reads would block a
    sidecar that logs much); ``corrupt_chunk``: one whose sender corrupts that chunk of every
    transfer (``kvferry.testing.faults.corrupt_chunk``)."""
    port, data_port = free_port(), free_port()
    entry = "kvferry.cli"
    if corrupt_chunk is not None:
        env, entry = {**(env or {}), faults.CORRUPT_CHUNK: str(corrupt_chunk)}, "kvferry.testing.serve"
    log = log_path(port)
    process = start_sidecar(port, data_port, backend, token=TOKEN, extra=extra, env=env, device=device, entry=entry,
                            log=log)
    return ready(f"http://127.0.0.1:{port}", process, log)


def ready(url: str, process: subprocess.Popen, log: Path) -> Daemon:
    """The sidecar started as ``process``, once it answers; raises with the end of its log if it
    exits or does not become ready."""
    daemon = Daemon(url, Client(url, token=TOKEN), process, log=log)
    spawned.append(daemon)
    try:
        wait_ready(daemon.client, process)
        daemon.data = daemon.client.data_address()
    except Exception as exc:
        daemon.client.close()
        if process.poll() is None:
            daemon.kill()
        raise RuntimeError(f"{exc}; its log ({log}) ends:\n{daemon.log_tail()}") from exc
    return daemon


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

