"""The sending sidecar SIGKILLed at several points of a transfer: the receiver fails
its side at once (the connection is gone) — not after ``transfer_timeout`` — frees the region,
reports nothing done that was not written, and serves the next sender bit-exact."""

from __future__ import annotations

import time

import pytest
import torch

from kvferry.engine import errors
from tests.conftest import bits_equal
from tests.engine.conftest import kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow
TIMEOUT = 20  # the receiver must notice long before this


@pytest.mark.parametrize("after_chunks", [0, 3])
def test_sender_killed_mid_transfer(kv, after_chunks):
    env = {"KVFERRY_TRANSFER_TIMEOUT": str(TIMEOUT), "KVFERRY_CHUNK_BYTES": str(1 << 20),
           "KVFERRY_EMULATED_LINK_GBPS": "0.02"}  # paced: the transfer is in flight for seconds
    a, b = spawn("tcp", env), spawn("tcp", env)
    try:
        big = kv.repeat(4, 1, 1, 1)  # 240 blocks, 47 MB
        a.client.region_from_tensor("src", big)
        b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
        transfer = a.client.submit("src", range(240), b.data, "dst", range(240), codec="raw")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                state = b.client.transfer(transfer)
                if state["blocks_done"] >= after_chunks * 5 and (after_chunks or state["state"] == "running"):
                    break
            except errors.NotFound:
                pass
            time.sleep(0.01)
        a.kill()  # SIGKILL: no goodbye, no CANCEL
        killed = time.monotonic()
        result = b.client.transfer(transfer, wait=TIMEOUT + 5)
        assert result["state"] == "failed" and result["error"], result
        assert time.monotonic() - killed < TIMEOUT / 2  # the lost connection, not the timeout
        assert result["blocks_done"] < 240
        b.client.delete_region("dst")  # released
        c = spawn("tcp", env)
        try:  # the receiver serves the next sender
            b.client.create_region("dst", 4, list(kv.shape[1:]), "bfloat16")
            c.client.region_from_tensor("src", kv[:4])
            assert c.client.wait(c.client.submit("src", range(4), b.data, "dst", [3, 2, 1, 0]), timeout=30)
            got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("dst", i)), dtype=torch.bfloat16)
                               .view(kv.shape[1:]) for i in (3, 2, 1, 0)])
            assert bits_equal(got, kv[:4])
        finally:
            stop(c)
    finally:
        stop(a, b)
