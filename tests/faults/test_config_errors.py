"""Configuration mistakes end the daemon with one line naming the setting, exit code 2, no
traceback, and nothing listens beyond loopback without its secret."""

from __future__ import annotations

import glob
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.client import Client
from kvferry.demo import free_port, wait_ready
from kvferry.transport import backends


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
    (("--transport-backend", "ucxx"), {}, "KVFERRY_PEER_SECRET"),  # its listener binds every interface
])
def test_one_line_exit_2(args, env, named):
    result = _serve(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_without_a_peer_secret_the_data_port_stays_on_loopback_whatever_the_backend():
    """``auto`` would pick ucxx where it imports and RDMA is there, whose listener binds every
    interface: without a secret the daemon takes tcp on ``data_host`` instead, and says so."""
    outward = _outward_address()
    if outward is None:
        pytest.skip("no address beyond loopback to probe from")
    port, data_port = free_port(), free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
    process = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "serve", "--port", str(port),
                                "--data-port", str(data_port), "--transport-backend", "auto", "--device", "cpu"],
                               env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = Client(f"http://127.0.0.1:{port}")
        wait_ready(client, process)
        info = {(s.labels.get("transport_backend"), s.labels.get("gpu_sharing"))
                for f in text_string_to_metric_families(client.metrics()) for s in f.samples
                if f.name == "kvferry_build_info"}
        assert info == {("tcp", "none")}, info  # a CPU sidecar shares no GPU
        socket.create_connection(("127.0.0.1", data_port), timeout=5).close()
        with pytest.raises(OSError):
            socket.create_connection((outward, data_port), timeout=5).close()
        client.close()
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    if importlib.util.find_spec("ucxx") is not None and glob.glob(backends.RDMA_DEVICES):
        assert "tcp, not ucxx" in stderr, stderr  # auto would have taken it: the log says why not


def test_a_typod_serve_option_shows_serves_usage_and_the_option_meant():
    result = _serve("--data-prot", "7701")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "usage: kvferry serve" in result.stderr and "--data-port DATA_PORT" in result.stderr
    assert "unrecognized arguments: --data-prot 7701 (did you mean --data-port?)" in result.stderr


@pytest.mark.parametrize("source", ["env", "file"])
def test_an_unknown_setting_names_the_setting_meant(source, tmp_path):
    if source == "env":
        result = _serve(env={"KVFERRY_MAX_CONECTIONS": "3"})
        expected = "['KVFERRY_MAX_CONECTIONS'] (did you mean KVFERRY_MAX_CONNECTIONS?)"
    else:
        config = tmp_path / "kvferry.yaml"
        config.write_text("max_conections: 3\ntransfer_timout: 5\nzzz: 1\n")
        result = _serve("--config", str(config))
        expected = ("['max_conections', 'transfer_timout', 'zzz'] (did you mean max_connections for max_conections, "
                    "transfer_timeout for transfer_timout?)")
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
