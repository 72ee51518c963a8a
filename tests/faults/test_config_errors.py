"""Configuration mistakes end the daemon with one line naming the setting, exit code 2, no
traceback (issue 15: finding 11), and nothing listens beyond loopback without its secret (7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize("args, env, named", [
    (("--port", "seventeen"), {}, "seventeen"),
    ((), {"KVFERRY_PROT": "7700"}, "KVFERRY_PROT"),
    (("--device", "gpu"), {}, "device"),
    ((), {"KVFERRY_TRANSFER_TIMEOUT": "soon"}, "transfer_timeout"),
    (("--host", "0.0.0.0"), {}, "KVFERRY_TOKEN"),
    (("--data-host", "0.0.0.0"), {}, "KVFERRY_PEER_SECRET"),
])
def test_one_line_exit_2(args, env, named):
    result = _serve(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
