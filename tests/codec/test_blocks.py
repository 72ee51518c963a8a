"""Paged-KV API on the CPU: encode_blocks == encode(cache[ids]); decode_blocks touches only its slots."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from tests.conftest import DTYPES, bits_equal


def _cache(dtype: torch.dtype, blocks: int = 12, block_shape=(2, 16, 8)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(blocks, *block_shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_blocks_same_bytes_as_gather(dtype):
    cache = _cache(dtype)
    ids = [7, 2, 2, 11, 0]
    book = codec.calibrate(cache)
    frame = codec.encode_blocks(cache, ids, book)
    assert torch.equal(frame, codec.encode(cache[ids], book))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_blocks_writes_only_listed(dtype):
    src = _cache(dtype)
    ids_src, ids_dst = [1, 5, 9], [10, 0, 4]
    frame = codec.encode_blocks(src, ids_src)
    dst = torch.zeros_like(src)
    codec.decode_blocks(frame, dst, ids_dst)
    assert bits_equal(dst[ids_dst], src[ids_src])
    untouched = [i for i in range(dst.shape[0]) if i not in ids_dst]
    assert torch.count_nonzero(dst[untouched].float()) == 0


def test_decode_blocks_rejects_and_writes_nothing():
    src = _cache(torch.bfloat16)
    frame = codec.encode_blocks(src, [0, 1])
    dst = torch.zeros_like(src)
    with pytest.raises(codec.OutputMismatch):
        codec.decode_blocks(frame, dst, [0, 1, 2])  # wrong block count
    with pytest.raises(codec.OutputMismatch):
        codec.decode_blocks(frame, dst, [3, 3])  # repeated slot
    with pytest.raises(codec.OutputMismatch):
        codec.decode_blocks(frame, torch.zeros(12, 2, 16, 4, dtype=torch.bfloat16), [0, 1])  # block shape
    with pytest.raises(codec.BlockOutOfRange):
        codec.decode_blocks(frame, dst, [0, 12])
    with pytest.raises(codec.CorruptFrame):
        codec.decode_blocks(frame[:-1], dst, [0, 1])
    assert torch.count_nonzero(dst.float()) == 0


def test_encode_blocks_bad_ids():
    with pytest.raises(codec.BlockOutOfRange):
        codec.encode_blocks(_cache(torch.bfloat16), [-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_into_buffer(dtype):
    cache = _cache(dtype)
    book = codec.calibrate(cache)
    out = torch.full((codec.frame_capacity((3, 2, 16, 8), dtype),), 0xAB, dtype=torch.uint8)
    length = codec.encode_blocks_into(cache, [4, 1, 8], book, out)
    assert torch.equal(out[: int(length)], codec.encode(cache[[4, 1, 8]], book))
    length = codec.encode_into(cache[2], book, out)
    assert torch.equal(out[: int(length)], codec.encode(cache[2], book))
    with pytest.raises(codec.OutputMismatch, match="frame_capacity"):
        codec.encode_into(cache, book, out)
