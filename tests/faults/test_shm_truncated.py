"""A worker truncates the shared-memory segment it registered (``kind=shm``): block reads and
writes, transfers from it and into it (streamed, and written straight into it by a same-host
sender under a lease) fail with ``RegionMemoryGone`` instead of killing a daemon with SIGBUS,
and both daemons go on serving (real daemons, tcp, token and peer secret on)."""

from __future__ import annotations

import os

import httpx
import pytest

from kvferry.engine import errors
from tests.engine.conftest import TOKEN, kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def daemons():
    a, b = spawn("tcp"), spawn("tcp")
    yield a, b
    stop(a, b)


def _alive(*daemons) -> None:
    for d in daemons:
        assert d.process.poll() is None, "the daemon died"
        assert httpx.get(f"{d.url}/healthz", timeout=10).status_code == 200


def _truncate(shm, size: int = 4096) -> None:
    os.ftruncate(shm._fd, size)


def test_block_reads_and_writes_of_a_truncated_segment_are_409(daemons, kv):
    a, _ = daemons
    _, shm = a.client.region_from_tensor("cut", kv[:4], kind="shm")
    try:
        assert a.client.get_block("cut", 3) == kv[3].contiguous().view(-1).view(torch_uint8()).numpy().tobytes()
        _truncate(shm)
        for method, content in (("GET", None), ("PUT", bytes(a.client.region("cut")["block_bytes"]))):
            response = httpx.request(method, f"{a.url}/v1/regions/cut/blocks/3", headers=AUTH, content=content)
            assert response.status_code == 409, response.text
            assert response.json()["error"] == "RegionMemoryGone" and "truncated" in response.json()["detail"]
        with pytest.raises(errors.RegionMemoryGone):
            a.client.get_block("cut", 0)
        assert "truncated" in a.client.region("cut")["memory"]
        _alive(a)
        a.client.delete_region("cut")  # a truncated region can still be let go
    finally:
        shm.close()
        shm.unlink()


def test_a_transfer_from_a_truncated_segment_fails_cleanly(daemons, kv):
    a, b = daemons
    _, shm = a.client.region_from_tensor("src-cut", kv[:4], kind="shm")
    b.client.create_region("dst-owned", 4, list(kv.shape[1:]), "bfloat16")
    try:
        _truncate(shm)
        for codec in ("raw", "splitzip"):
            with pytest.raises(errors.RegionMemoryGone):
                transfer = a.client.submit("src-cut", [0, 1, 2, 3], b.data, "dst-owned", [0, 1, 2, 3], codec=codec)
                a.client.wait(transfer, timeout=30)
        _alive(a, b)
        a.client.delete_region("src-cut")
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("codec", ["raw", "splitzip"])
def test_a_transfer_into_a_truncated_segment_fails_cleanly(daemons, kv, codec):
    """The first transfer leases the segment to the same-host sender, which then writes into it
    itself; after the truncation neither the receiver nor the sender touch it."""
    a, b = daemons
    name = f"dst-cut-{codec}"
    a.client.region_from_tensor(f"src-{codec}", kv[:4])
    _, shm = b.client.region_from_tensor(name, kv[:4] * 0, kind="shm")
    try:
        for _ in range(2):  # the second rides the lease the first one left
            transfer = a.client.submit(f"src-{codec}", [0, 1], b.data, name, [0, 1], codec=codec)
            assert a.client.wait(transfer, timeout=30)["state"] == "done"
        _truncate(shm)
        for blocks in ([0, 1], [2, 3], [0, 1, 2, 3]):
            transfer = a.client.submit(f"src-{codec}", blocks, b.data, name, blocks, codec=codec)
            with pytest.raises(errors.TransferFailed) as failed:
                a.client.wait(transfer, timeout=30)
            assert "truncated" in str(failed.value) or "holds 4096 bytes" in str(failed.value), failed.value
        _alive(a, b)
        assert not b.client.region(name)["busy_transfers"]
        b.client.delete_region(name)
        # The sidecars still move blocks between regions that are whole.
        b.client.create_region(f"dst-{codec}", 4, list(kv.shape[1:]), "bfloat16")
        transfer = a.client.submit(f"src-{codec}", [0, 1, 2, 3], b.data, f"dst-{codec}", [0, 1, 2, 3], codec=codec)
        assert a.client.wait(transfer, timeout=30)["state"] == "done"
        assert b.client.get_block(f"dst-{codec}", 2) == a.client.get_block(f"src-{codec}", 2)
    finally:
        shm.close()
        shm.unlink()


def torch_uint8():
    import torch

    return torch.uint8
