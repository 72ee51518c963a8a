"""An owned GPU region is an allocation of its own: lent to a same-host sender as a CUDA IPC
handle, which maps the whole allocation, it exposes none of the sidecar's other GPU memory (torch's
caching allocator would put small regions, receive buffers and codec scratch side by side in one
segment). Zeroed when registered; writable and readable as any region."""

from __future__ import annotations

import gc

import pytest
import torch

from kvferry.engine import RegionSpec, ipc
from kvferry.engine.regions import RegionTable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ipc.available(), reason="needs a CUDA GPU and CuPy")]


def test_each_owned_gpu_region_is_its_own_allocation_and_lent_alone():
    table = RegionTable(torch.device("cuda:0"))
    beside = torch.ones(1 << 14, device="cuda:0")  # torch's own memory, as a receive buffer would be
    regions = [table.register(RegionSpec(name, 16, (1024,), "bfloat16")) for name in ("a", "b")]  # 32 KiB each
    for region in regions:
        pointer, nbytes = region.tensor.data_ptr(), region.tensor.numel() * region.tensor.element_size()
        base, size = ipc.address_range(pointer)
        assert base == pointer and nbytes <= size < nbytes + (2 << 20)
        handle, offset, _ = ipc.export(region.tensor)
        assert offset == 0 and len(handle) == ipc.HANDLE_BYTES
        for other in [beside, *(r.tensor for r in regions if r is not region)]:
            assert not base <= other.data_ptr() < base + size  # nothing else of this process is lent with it
        assert int(region.tensor.view(torch.int16).count_nonzero()) == 0  # zeroed
    a = regions[0].tensor
    a.copy_(torch.randn(a.shape, device="cuda:0").to(a.dtype))
    assert torch.equal(a.cpu().cuda(), a)
    free_before = torch.cuda.mem_get_info(0)[0]
    table.register(RegionSpec("big", 64, (1 << 20,), "bfloat16"))  # 128 MiB
    assert torch.cuda.mem_get_info(0)[0] <= free_before - (128 << 20)
    table.delete("big")
    gc.collect()
    assert torch.cuda.mem_get_info(0)[0] >= free_before - (16 << 20)  # freed to the driver with the region
