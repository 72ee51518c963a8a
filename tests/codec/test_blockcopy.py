"""Whole-block gather-scatter: the GPU kernel writes exactly the bits the torch reference writes,
into the same GPU and a peer's, and touches no other block."""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from kvferry.codec import blockcopy
from tests.conftest import bits_equal

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _cache(blocks: int, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random bits, NaN/Inf/-0/subnormal patterns included (any 8/16-bit pattern is some value)."""
    bits = torch.randint(0, 256, (blocks, *shape[:-1], shape[-1] * (2 if dtype.itemsize == 2 else 1)),
                         generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return bits.view(dtype).to(device)


def _expected(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> torch.Tensor:
    out = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        out[d] = src[s]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_copy_is_the_reference(dtype):
    src, dst = _cache(12, (4, 16), dtype, "cpu", 1), _cache(9, (4, 16), dtype, "cpu", 2)
    src_ids, dst_ids = [11, 0, 5, 5], [3, 8, 0, 1]  # a source block may go to two places
    expected = _expected(src, src_ids, dst, dst_ids)
    blockcopy.copy_blocks(src, torch.tensor(src_ids), dst, torch.tensor(dst_ids))
    assert bits_equal(dst, expected)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or blockcopy._module(0) is None,
                         reason="needs a CUDA GPU and CuPy")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("shape", [(16, 8, 128), (7, 3)])  # the GPU's memcpy path; odd sizes: torch's
def test_a_few_listed_blocks_are_copied_as_the_reference_copies_them(device, shape):
    src, dst = _cache(12, shape, torch.bfloat16, device, 6), _cache(9, shape, torch.bfloat16, device, 7)
    src_ids, dst_ids = (11, 0, 5, 5), (3, 8, 0, 1)
    expected = _expected(src, list(src_ids), dst, list(dst_ids))
    blockcopy.copy_listed(src, src_ids, dst, dst_ids)
    if device == "cuda":
        torch.cuda.synchronize()
    assert bits_equal(dst, expected)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8, 128), (3, 5, 16), (7, 3)])  # 32 KiB blocks; odd sizes: the torch path
def test_gpu_kernel_writes_the_reference_bits(dtype, shape):
    src, dst = _cache(300, shape, dtype, "cuda", 3), _cache(200, shape, dtype, "cuda", 4)
    generator = torch.Generator().manual_seed(5)
    src_ids = torch.randperm(300, generator=generator)[:150].tolist()
    dst_ids = torch.randperm(200, generator=generator)[:150].tolist()
    expected = _expected(src, src_ids, dst, dst_ids)
    fits = blockcopy._kernel_fits(src, dst)
    assert fits == (src[0].nbytes % 16 == 0)
    blockcopy.copy_blocks(src, torch.tensor(src_ids, device="cuda"), dst, torch.tensor(dst_ids, device="cuda"))
    torch.cuda.synchronize()
    assert bits_equal(dst, expected)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 8, 128), (8, 8, 128), (4, 5, 24)])  # 32 KiB, 16 KiB, 60 vectors
def test_many_pages_take_the_page_kernel_and_write_the_reference_bits(shape):
    blocks = blockcopy.PAGE_MIN_BLOCKS + 476
    src, dst = _cache(2 * blocks, shape, torch.bfloat16, "cuda", 8), _cache(2 * blocks, shape, torch.bfloat16, "cuda", 9)
    generator = torch.Generator().manual_seed(10)
    src_ids = torch.randperm(2 * blocks, generator=generator)[:blocks].tolist()
    dst_ids = torch.randperm(2 * blocks, generator=generator)[:blocks].tolist()
    expected = _expected(src, src_ids, dst, dst_ids)
    assert src[0].nbytes // blockcopy.VEC <= blockcopy.PAGE_VECS and blockcopy._kernel_fits(src, dst)
    blockcopy.copy_blocks(src, torch.tensor(src_ids, device="cuda"), dst, torch.tensor(dst_ids, device="cuda"))
    torch.cuda.synchronize()
    assert bits_equal(dst, expected)


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_kernel_writes_into_a_peer_gpu():
    src, dst = _cache(64, (16, 8, 128), torch.bfloat16, "cuda:0", 6), _cache(64, (16, 8, 128), torch.bfloat16, "cuda:1", 7)
    src_ids, dst_ids = list(range(0, 64, 2)), list(range(63, 0, -2))
    expected = _expected(src.cpu(), src_ids, dst.cpu(), dst_ids)
    blockcopy.copy_blocks(src, torch.tensor(src_ids, device="cuda:0"), dst, torch.tensor(dst_ids, device="cuda:0"))
    torch.cuda.synchronize(0)
    assert bits_equal(dst.cpu(), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("shape, count", [((16, 8, 128), 4), ((8, 8, 128), 72), ((7, 3), 3)])  # blocks, pages, odd
def test_spread_ids_copy_every_block_they_stand_for(device, shape, count):
    """vLLM's request across a cache's layer planes: ids ``b`` standing for ``b + j * stride``; the
    destination's stride differs (a cache of another size) and may run backwards."""
    src_stride, dst_stride = 40, -30
    src, dst = _cache(count * src_stride, shape, torch.bfloat16, device, 11), \
        _cache(count * 30, shape, torch.bfloat16, device, 12)
    src_ids, dst_ids = [7, 0, 39, 12], [29 + (count - 1) * 30, (count - 1) * 30, 3 + (count - 1) * 30, 17 + (count - 1) * 30]
    every_src = [s + j * src_stride for s in src_ids for j in range(count)]
    every_dst = [d + j * dst_stride for d in dst_ids for j in range(count)]
    assert len(set(every_dst)) == len(every_dst) and min(every_dst) >= 0
    expected = _expected(src, every_src, dst, every_dst)
    assert blockcopy.spread(torch.tensor(src_ids), count, src_stride).tolist() == every_src
    blockcopy.copy_spread(src, torch.tensor(src_ids, device=device), dst, torch.tensor(dst_ids, device=device), count,
                          src_stride, dst_stride)
    if device == "cuda":
        torch.cuda.synchronize()
    assert bits_equal(dst, expected)


def test_listed_arguments_are_laid_out_as_the_kernel_takes_them():
    """``copy_listed_blocks(src, dst, Listed src_ids, Listed dst_ids, blocks, vecs)``: six
    argument pointers at their fields, each id list ``LISTED_MAX`` u32 long."""
    address = blockcopy._listed_arguments(0x1000, 0x2000, (7, 0, 255), (3, 9, 1), 131072)
    held = blockcopy._listed_thread.arguments
    base = ctypes.addressof(held)
    width = 4 * blockcopy.LISTED_MAX
    assert address == base + blockcopy._ListedArguments.pointers.offset
    assert [p - base for p in held.pointers] == [0, 8, 16, 16 + width, 16 + 2 * width, 24 + 2 * width]
    raw = ctypes.string_at(base, 32 + 2 * width)
    assert raw[:16] == struct.pack("<QQ", 0x1000, 0x2000)
    assert raw[16:28] == struct.pack("<3I", 7, 0, 255) and raw[16 + width:28 + width] == struct.pack("<3I", 3, 9, 1)
    assert raw[16 + 2 * width:] == struct.pack("<qq", 3, 131072)
    assert 32 + 2 * width <= 4096  # what a kernel's arguments may take


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("where", ["one GPU", pytest.param("into a peer", marks=two_gpus)])
@pytest.mark.parametrize("count", [1, 5, 37, blockcopy.LISTED_MAX])
def test_blocks_listed_in_the_launch_are_copied_as_the_reference_copies_them(where, count):
    shape = (16, 8, 128)
    src = _cache(300, shape, torch.bfloat16, "cuda:0", 11)
    dst = _cache(300, shape, torch.bfloat16, "cuda:1" if where == "into a peer" else "cuda:0", 12)
    generator = torch.Generator().manual_seed(count)
    src_ids = tuple(torch.randint(0, 300, (count,), generator=generator).tolist())  # repeats allowed
    dst_ids = tuple(torch.randperm(300, generator=generator)[:count].tolist())
    expected = _expected(src.cpu(), list(src_ids), dst.cpu(), list(dst_ids))
    planned = blockcopy.route(src, dst)
    assert planned is not None and planned.device == 0
    assert blockcopy.copy_by_value(planned, src_ids, dst_ids, torch.cuda.current_stream(0).cuda_stream)
    torch.cuda.synchronize(0)
    assert bits_equal(dst.cpu(), expected)  # other blocks untouched too


@gpu
@pytest.mark.gpu
def test_more_blocks_than_a_launch_lists_are_left_to_the_index_path():
    src = _cache(600, (4, 16), torch.bfloat16, "cuda", 13)
    planned = blockcopy.route(src, src.clone())
    ids = tuple(range(blockcopy.LISTED_MAX + 1))
    assert not blockcopy.copy_by_value(planned, ids, ids, torch.cuda.current_stream().cuda_stream)
