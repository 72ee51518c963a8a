"""Owned regions and the host's memory: a region larger than the memory free now is 507
(``InsufficientStorage``), never a 500 or an OOM kill; one over ``max_region_bytes`` is 413, and
by default that cap is half the host's memory."""

from __future__ import annotations

import gc
import os

import httpx
import pytest
import torch

from kvferry.engine import errors, regions
from kvferry.engine.settings import Settings
from tests.engine.conftest import TOKEN, spawn, stop
from tests.engine.test_leases import _mapped

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def _region(name: str, nbytes: int) -> dict:
    """An owned bfloat16 region of about ``nbytes``, in 64 MiB blocks."""
    return {"name": name, "num_blocks": max(1, nbytes >> 26), "block_shape": [1 << 25], "dtype": "bfloat16"}


@pytest.mark.slow
def test_a_region_larger_than_free_memory_is_507_and_the_daemon_serves_on():
    d = spawn("tcp", {"KVFERRY_MAX_REGION_BYTES": str(1 << 50)})
    try:
        for nbytes in (1 << 45, 2 * _mem_total()):  # far past the memory, and just past it
            response = httpx.post(f"{d.url}/v1/regions", headers=AUTH, json=_region("big", nbytes), timeout=60)
            assert response.status_code == 507, response.text
            assert response.json()["error"] == "InsufficientStorage" and "free" in response.json()["detail"]
        with pytest.raises(errors.InsufficientStorage):
            d.client.create_region("big", 1 << 19, [1 << 25], "bfloat16")
        assert d.process.poll() is None
        d.client.create_region("small", 4, [1 << 10], "bfloat16")  # what fits is still served
        assert d.client.region("small")["memory"] == "ok"
    finally:
        stop(d)


@pytest.mark.slow
def test_by_default_a_region_over_half_the_host_memory_is_413():
    d = spawn("tcp")
    try:
        nbytes = 3 * _mem_total() // 2  # under the old fixed 64 GiB cap on most hosts
        response = httpx.post(f"{d.url}/v1/regions", headers=AUTH, json=_region("big", nbytes), timeout=60)
        assert response.status_code == 413, response.text
        assert "max_region_bytes" in response.json()["detail"]
        assert d.process.poll() is None
    finally:
        stop(d)


def test_the_default_cap_is_half_the_memory():
    assert Settings().max_region_bytes == 0
    Settings().check()
    with pytest.raises(ValueError, match="max_region_bytes"):
        Settings(max_region_bytes=-1).check()
    table = regions.RegionTable(torch.device("cpu"), 0)
    with pytest.raises(errors.PayloadTooLarge, match="max_region_bytes"):
        table.register(regions.RegionSpec("x", (_mem_total() // 2 >> 21) + 1, (1 << 20,), "bfloat16"))
    assert len(table) == 0


def test_an_allocator_refusal_is_insufficient_storage(monkeypatch):
    """Past the free-memory check (here: memory said to be unknown), the allocator's own refusal
    is the same 507. A petabyte is past any host's address space: refused at once, nothing touched."""
    monkeypatch.setattr(regions, "free_bytes", lambda device: None)
    table = regions.RegionTable(torch.device("cpu"), 1 << 62)
    with pytest.raises(errors.InsufficientStorage, match="cannot allocate"):
        table.register(regions.RegionSpec("x", 1 << 29, (1 << 20,), "bfloat16"))
    assert len(table) == 0


def test_a_shared_memory_region_deleted_while_a_view_of_it_lives_is_deleted():
    """A view of a region's memory may outlive the region by a moment (a worker thread that ran a
    codec call into it holds the call's arguments until its next call): the delete succeeds and
    closes the descriptor, and the mapping goes with the view, which reads the memory until then."""
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(name=f"kvferry-view{os.getpid()}", create=True, size=4 * 1024 * 2)
    try:
        table = regions.RegionTable(torch.device("cpu"), 1 << 30)
        region = table.register(regions.RegionSpec("dst", 4, (1024,), "bfloat16", kind="shm", shm_name=segment.name))
        view = region.tensor[2]
        view.view(torch.int16).fill_(7)
        fd = region._keepalive._fd
        table.delete("dst")
        with pytest.raises(errors.NotFound):
            table.get("dst")
        with pytest.raises(OSError):
            os.fstat(fd)
        assert torch.equal(view.view(torch.int16), torch.full((1024,), 7, dtype=torch.int16))
        assert _mapped(segment.name) == 2  # this test's own and the view's
        del view
        gc.collect()
        assert _mapped(segment.name) == 1
    finally:
        segment.close()
        segment.unlink()
