from __future__ import annotations

import pytest

from tests.engine.conftest import TOKEN, Daemon, log_path, ready, spawn, stop

__all__ = ["TOKEN", "Daemon", "log_path", "ready", "spawn", "stop"]


@pytest.fixture(scope="module")
def sidecars():
    """A prefill-side and a decode-side sidecar: real processes on loopback ports."""
    a, b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"}), spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"})
    yield a, b
    stop(a, b)
