"""The ``raw`` codec's blocks: stored frames written as they are, every header checked first."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from kvferry.codec.frames import encode_stored
from tests.conftest import bits_equal


@pytest.fixture()
def cache() -> torch.Tensor:
    return torch.randn(4, 2, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def test_blocks_round_trip(cache):
    raw = codec.get("raw")
    frame = raw.encode_blocks(cache, torch.tensor([2, 0]))
    out = torch.zeros_like(cache)
    raw.decode_blocks(frame, out, torch.tensor([1, 3]))
    assert bits_equal(out[1], cache[2]) and bits_equal(out[3], cache[0])
    assert not out[[0, 2]].view(torch.int16).any()


def test_a_stored_frame_with_a_stream_checksum_is_written(cache):
    """Stored frames may carry a stream checksum (the other codecs' stored frames do when asked
    to): the blocks are written once it matches, and nothing is written when it does not."""
    raw = codec.get("raw")
    frame = encode_stored(cache[[2, 0]], checksum=True)
    assert codec.codec_of(frame) is raw
    out = torch.zeros_like(cache)
    raw.decode_blocks(frame, out, torch.tensor([1, 3]))
    assert bits_equal(out[1], cache[2]) and bits_equal(out[3], cache[0])
    assert not out[[0, 2]].view(torch.int16).any()
    bad = frame.clone()
    bad[-1] ^= 0x01
    out = torch.zeros_like(cache)
    with pytest.raises(codec.CorruptFrame, match="checksum"):
        raw.decode_blocks(bad, out, torch.tensor([1, 3]))
    assert not out.view(torch.int16).any()


@pytest.mark.parametrize("checksum", [False, True])
def test_a_frame_of_other_blocks_says_what_differs(cache, checksum):
    raw = codec.get("raw")
    frame = encode_stored(cache[[2, 0]], checksum=checksum)
    with pytest.raises(codec.OutputMismatch, match=r"dtype differs$"):
        raw.decode_blocks(frame, torch.zeros(4, 2, 512, dtype=torch.float16), torch.tensor([1, 3]))
    with pytest.raises(codec.OutputMismatch, match=r"shape differs$"):
        raw.decode_blocks(frame, torch.zeros(4, 2, 256, dtype=torch.bfloat16), torch.tensor([1, 3]))
    with pytest.raises(codec.OutputMismatch, match=r"shape differs$"):
        raw.decode_blocks(frame, torch.zeros_like(cache), torch.tensor([1, 3, 0]))
    with pytest.raises(codec.OutputMismatch, match=r"dtype and shape differ$"):
        raw.decode_blocks(frame, torch.zeros(4, 512, dtype=torch.float16), torch.tensor([1, 3]))
