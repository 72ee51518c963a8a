"""Faults end to end: a peer killed mid-transfer, a corrupt chunk on the wire. Each transfer ends
failed with a reason, nothing is reported done, and the surviving daemon keeps serving."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from kvferry.engine import errors
from tests.engine.conftest import spawn, stop

pytestmark = pytest.mark.slow


# Senders paced to 50 MB/s: the 94 MB transfers below stay in flight for about two seconds.
SLOW = {"KVFERRY_CHUNK_BYTES": str(1 << 20), "KVFERRY_EMULATED_LINK_GBPS": "0.05"}


def test_receiver_killed_mid_transfer(kv):
    env = dict(SLOW, KVFERRY_TRANSFER_TIMEOUT="3")
    a, b = spawn("tcp", env), spawn("tcp", env)
    try:
        big = kv.repeat(8, 1, 1, 1)  # 94 MB, splitzip on the CPU: seconds
        a.client.region_from_tensor("src", big)
        b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
        ids = list(range(big.shape[0]))
        transfer = a.client.submit("src", ids, b.data, "dst", ids, codec="splitzip")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if b.client.transfer(transfer)["blocks_done"] > 0:
                    break
            except errors.NotFound:  # not announced yet
                pass
            time.sleep(0.01)
        b.kill()
        killed = time.monotonic()
        result = a.client.transfer(transfer, wait=30)
        assert result["state"] == "failed" and result["error"], result
        assert time.monotonic() - killed < 15
        assert httpx.get(f"{a.url}/healthz").status_code == 200
        # The sender still works with a new peer.
        c = spawn("tcp", env)
        try:
            c.client.create_region("dst", 4, list(kv.shape[1:]), "bfloat16")
            again = a.client.submit("src", [0, 1], c.data, "dst", [0, 1], codec="raw")
            assert a.client.wait(again, timeout=30)["state"] == "done"
        finally:
            stop(c)
    finally:
        stop(a, b)


def test_corrupt_chunk_fails_the_transfer(kv):
    env = {"KVFERRY_TRANSFER_TIMEOUT": "5", "KVFERRY_CHUNK_BYTES": str(1 << 20)}
    a = spawn("tcp", env, corrupt_chunk=0)
    b = spawn("tcp", env)
    try:
        a.client.region_from_tensor("src", kv)
        b.client.create_region("dst", 60, list(kv.shape[1:]), "bfloat16")
        ids = list(range(60))
        transfer = a.client.submit("src", ids, b.data, "dst", ids, codec="splitzip")
        result = a.client.transfer(transfer, wait=60)
        incoming = b.client.transfer(transfer, wait=60)
        assert result["state"] == "failed" and incoming["state"] == "failed"
        assert "CorruptFrame" in incoming["error"] and "chunk 0" in incoming["error"]
        assert incoming["blocks_done"] == 0  # the corrupt first chunk: nothing reported written
        assert not any(b.client.get_block("dst", i) != bytes(len(b.client.get_block("dst", i))) for i in range(5))
        assert httpx.get(f"{b.url}/healthz").status_code == 200
        errors_metric = b.client.metrics()
        assert 'kvferry_errors_total{kind="CorruptChunk"}' in errors_metric  # the peer's bad data
        assert incoming["error_kind"] == "CorruptChunk" and 'kind="BadRequest"' not in errors_metric
        name = f"x{uuid.uuid4().hex[:6]}"
        b.client.create_region(name, 1, [4], "bfloat16")  # still serving
    finally:
        stop(a, b)


def test_graceful_shutdown_fails_in_flight_and_exits(kv):
    env = dict(SLOW, KVFERRY_TRANSFER_TIMEOUT="5")
    a, b = spawn("tcp", env), spawn("tcp", env)
    try:
        big = kv.repeat(8, 1, 1, 1)
        a.client.region_from_tensor("src", big)
        b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
        ids = list(range(big.shape[0]))
        transfer = a.client.submit("src", ids, b.data, "dst", ids, codec="splitzip")
        deadline = time.monotonic() + 30
        while a.client.transfer(transfer)["bytes_wire"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        a.process.terminate()  # SIGTERM: stop accepting, fail what is in flight, exit
        # uvicorn re-raises the signal after its graceful shutdown, so the exit status is -SIGTERM
        assert a.process.wait(timeout=20) in (0, -15)
        incoming = b.client.transfer(transfer, wait=30)
        # cancelled, not failed: the sender told the receiver on its way out (an abrupt death
        # would surface as a lost peer instead)
        assert incoming["state"] == "cancelled" and incoming["error"], (incoming["error_kind"], incoming["error"])
        assert incoming["blocks_done"] < len(ids)
    finally:
        stop(a, b)
