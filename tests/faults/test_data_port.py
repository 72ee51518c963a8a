"""The data port under a connection flood and with idle connections: excess
connections are closed at once, silent ones at the handshake deadline, idle ones after
``idle_timeout``; real transfers keep working throughout."""

from __future__ import annotations

import socket
import time

import pytest

from tests.engine.conftest import kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.settimeout(10)
    return s


def test_flood_and_idle_connections(kv):
    env = {"KVFERRY_MAX_CONNECTIONS": "16", "KVFERRY_IDLE_TIMEOUT": "1"}
    a, b = spawn("tcp", env), spawn("tcp", env)
    flood: list[socket.socket] = []
    try:
        a.client.region_from_tensor("src", kv[:4])
        b.client.create_region("dst", 4, list(kv.shape[1:]), "bfloat16")
        flood = [_connect(b.data) for _ in range(40)]
        time.sleep(0.5)
        started = time.monotonic()
        closed_at_once = 0
        for s in flood[16:]:  # over the limit: closed without a word
            s.settimeout(2)
            try:
                closed_at_once += s.recv(1) == b""
            except OSError:
                closed_at_once += 1
        assert closed_at_once >= 20
        for s in flood[:16]:  # within the limit but silent: closed at the handshake deadline
            s.settimeout(15)
            try:
                assert s.recv(1) == b""
            except OSError:
                pass
        assert time.monotonic() - started < 15
        transfer = a.client.submit("src", [0, 1], b.data, "dst", [2, 3], codec="raw")
        assert a.client.wait(transfer, timeout=30)["state"] == "done"
        time.sleep(2.5)  # the pooled connection is idle past idle_timeout: the receiver closed it
        again = a.client.submit("src", [2, 3], b.data, "dst", [0, 1], codec="splitzip")
        assert a.client.wait(again, timeout=30)["state"] == "done"  # the sender reconnected
    finally:
        for s in flood:
            s.close()
        stop(a, b)
