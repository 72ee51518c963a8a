"""Two sidecars on one GPU host: raw (and auto) transfers are written straight into the receiver's
lent GPU memory (CUDA IPC), codec transfers stream; both bit-exact. Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine import ipc
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ipc.available(), reason="needs a CUDA GPU and CuPy")]


@pytest.fixture(scope="module")
def gpu_pair():
    env = {"KVFERRY_CHUNK_BYTES": str(4 << 20)}
    a, b = spawn("tcp", env, device="cuda"), spawn("tcp", env, device="cuda")
    yield a, b
    stop(a, b)


def _read(client, region: str, ids: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(client.get_block(region, i)), dtype=like.dtype)
                        .view(like.shape[1:]) for i in ids])


@pytest.mark.parametrize("codec", ["raw", "auto"])
def test_same_host_write_is_bit_exact_into_permuted_blocks(gpu_pair, kv, codec):
    a, b = gpu_pair
    src, dst = f"s-{codec}", f"d-{codec}"
    a.client.region_from_tensor(src, kv)
    b.client.create_region(dst, 64, list(kv.shape[1:]), "bfloat16")
    dst_ids = [63 - i for i in range(60)]
    result = a.client.wait(a.client.submit(src, range(60), b.data, dst, dst_ids, codec=codec), timeout=60)
    assert "CUDA IPC" in result["choice_reason"] and result["chosen_codec"] == "raw", result
    assert bits_equal(_read(b.client, dst, dst_ids, kv), kv)
    assert not _read(b.client, dst, [0, 1, 2, 3], kv).view(torch.uint8).any()
    incoming = b.client.transfer(result["id"])
    assert incoming["state"] == "done" and incoming["blocks_done"] == 60


def test_a_codec_asked_for_streams_instead(gpu_pair, kv):
    a, b = gpu_pair
    a.client.region_from_tensor("s-zip", kv)
    b.client.create_region("d-zip", 60, list(kv.shape[1:]), "bfloat16")
    result = a.client.wait(a.client.submit("s-zip", range(60), b.data, "d-zip", range(60), codec="splitzip"),
                           timeout=60)
    assert result["chosen_codec"] == "splitzip" and result["ratio"] > 1.3, result
    assert bits_equal(_read(b.client, "d-zip", list(range(60)), kv), kv)


def test_every_layer_in_one_transfer_into_the_workers_memory(gpu_pair, kv):
    a, b = gpu_pair
    layers = 4
    sources = [kv[i * 15:(i + 1) * 15].cuda() for i in range(layers)]
    targets = [torch.zeros(20, *kv.shape[1:], dtype=kv.dtype, device="cuda") for _ in range(layers)]
    for i in range(layers):
        a.client.region_from_tensor(f"ls{i}", sources[i], kind="cuda_ipc")
        b.client.region_from_tensor(f"ld{i}", targets[i], kind="cuda_ipc")
    pairs = [(f"ls{i}", f"ld{i}") for i in range(layers)]
    result = a.client.wait(a.client.submit_regions(pairs, range(15), b.data, range(19, 4, -1)), timeout=60)
    assert "CUDA IPC" in result["choice_reason"], result
    torch.cuda.synchronize()
    for source, target in zip(sources, targets):
        assert bits_equal(target[5:20].flip(0).cpu(), source.cpu())  # in this process's own tensors
        assert not target[:5].any()


def test_later_transfers_are_written_under_the_standing_lease(gpu_pair, kv):
    """The first transfer into a region is answered by an ACCEPT that lends it; later ones are
    written at once and announced behind the data (no ACCEPT stage); deleting the region takes
    the lease back, and a region of that name made again is lent afresh."""
    a, b = gpu_pair
    a.client.region_from_tensor("s-lease", kv)
    b.client.create_region("d-lease", 64, list(kv.shape[1:]), "bfloat16")
    first = a.client.wait(a.client.submit("s-lease", range(60), b.data, "d-lease", range(60), codec="raw"), timeout=60)
    assert "accepted" in first["stages"], first
    for shift in (1, 2, 3):
        dst_ids = [(7 * i + shift) % 64 for i in range(8)]
        result = a.client.wait(a.client.submit("s-lease", range(8), b.data, "d-lease", dst_ids, codec="raw"), timeout=60)
        assert "accepted" not in result["stages"] and "same host" in result["choice_reason"], result
        assert bits_equal(_read(b.client, "d-lease", dst_ids, kv), kv[:8])
        assert b.client.transfer(result["id"])["state"] == "done"
    b.client.delete_region("d-lease")
    b.client.create_region("d-lease", 64, list(kv.shape[1:]), "bfloat16")
    again = a.client.wait(a.client.submit("s-lease", range(4), b.data, "d-lease", [9, 8, 7, 6], codec="raw"), timeout=60)
    assert "accepted" in again["stages"], again
    assert bits_equal(_read(b.client, "d-lease", [9, 8, 7, 6], kv), kv[:4])


def test_a_worker_region_must_lie_inside_the_allocation_its_handle_maps(gpu_pair):
    """A cuda_ipc region's offset and size are the worker's word: held to the allocation its handle
    maps (and to its dtype's alignment), refused with a reason rather than mapped past its end,
    whose first touch would be a fault that ends every GPU transfer of the sidecar."""
    from kvferry.client.memory import cuda_ipc_handle
    from kvferry.engine.errors import BadRequest

    a, _ = gpu_pair
    owned = ipc.own_allocation(1 << 20, torch.device("cuda", 0))  # an allocation of its own
    start, size = ipc.address_range(owned.data_ptr())
    blocks = size // 4096  # of 2048 bfloat16
    lent = cuda_ipc_handle(owned.view(torch.bfloat16)[:blocks * 2048].view(blocks, 2048))
    base = lent["offset"]
    for offset, count in ((0, blocks + 1), (blocks * 4096, 1), (2048, blocks), (1, 1)):
        with pytest.raises(BadRequest):
            a.client.create_region("outside", count, [2048], "bfloat16", kind="cuda_ipc",
                                   **{**lent, "offset": base + offset})
    a.client.create_region("inside", blocks - 1, [2048], "bfloat16", kind="cuda_ipc", **{**lent, "offset": base + 4096})
    a.client.delete_region("inside")
