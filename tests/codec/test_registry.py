"""The codec registry's public surface: every registered codec calibrates, encodes, decodes
bit-exactly and round-trips its codebook through JSON; frames name their codec."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from tests.conftest import bits_equal


def test_names_and_unknown():
    assert codec.names()[:2] == ["raw", "splitzip"]
    with pytest.raises(codec.UnknownCodec, match="zstd"):
        codec.get("zstd")
    with pytest.raises(ValueError):
        codec.register(codec.RawCodec())  # a name is registered once


@pytest.mark.parametrize("name", codec.names())
def test_every_codec_round_trips(name, real_kv):
    c = codec.get(name)
    assert c.name == name and isinstance(c.lossless, bool)
    x = torch.stack(real_kv["c1_k"][:4])  # [4, 3, 511, 64] bf16
    book = c.calibrate(real_kv["c0_k"][:4], token_axis=1)
    again = c.codebook_from_json(book.to_json())
    frame = c.encode(x, again)
    assert frame.dtype == torch.uint8 and frame.dim() == 1 and frame.numel() <= c.capacity(x.shape, x.dtype)
    assert codec.codec_of(frame).name in (name, "raw")  # a frame that would not shrink is stored
    if c.lossless:
        assert bits_equal(c.decode(frame, again), x)
        out = torch.empty_like(x)
        c.decode(frame, again, out=out)
        assert bits_equal(out, x)
        cache = torch.zeros(6, *x.shape[1:], dtype=x.dtype)
        c.decode_blocks(c.encode_blocks(x, torch.tensor([3, 0]), again), cache, torch.tensor([5, 1]), again)
        assert bits_equal(cache[5], x[3]) and bits_equal(cache[1], x[0]) and not cache[0].view(torch.int16).any()


def test_codec_of_rejects_garbage():
    with pytest.raises(codec.CorruptFrame):
        codec.codec_of(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(codec.CorruptFrame, match="magic"):
        codec.codec_of(torch.zeros(200, dtype=torch.uint8))
