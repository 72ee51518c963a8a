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
    with pytest.raises(codec.InvalidArgument):
        codec.register(codec.RawCodec())  # a name is registered once


AXES = ("layer", "kv", "head", "token", "channel")


def _blocks(real_kv, chunk: int) -> torch.Tensor:
    """Real KV of 4 layers as 2 blocks of 255 tokens: [block, layer, kv, head, token, channel]."""
    x = torch.stack([torch.stack([real_kv[f"c{chunk}_k"][l], real_kv[f"c{chunk}_v"][l]]) for l in range(4)])
    return x[..., :510, :].reshape(4, 2, 3, 2, 255, 64).permute(3, 0, 1, 2, 4, 5).contiguous()


@pytest.mark.parametrize("name", codec.names())
def test_every_codec_round_trips(name, real_kv):
    """Calibrate (with the block's axes named), bind, encode_blocks, decode_blocks into other ids:
    lossless codecs give the bits back; lossy ones their own reconstruction, the same twice."""
    c = codec.get(name)
    assert c.name == name and isinstance(c.lossless, bool)
    cache, samples = _blocks(real_kv, 1), _blocks(real_kv, 0)
    layout = codec.BlockLayout(tuple(cache.shape[1:]), AXES)
    extra, ref_src, ref_dst = {}, None, None
    if name == "predictive":  # a predictor's KV: here, k8v4's reconstruction of the same blocks
        k8v4 = codec.get("k8v4")
        rough = lambda b: _through(k8v4, k8v4.bind(None, layout), b)  # noqa: E731
        extra = {"predictor": rough(samples)}
        ref_src, ref_dst = rough(cache), torch.zeros(3, *cache.shape[1:], dtype=cache.dtype)
        ref_dst[[2, 0]] = ref_src[[1, 0]]
    book = c.calibrate(samples, token_axis=4, axes=("block", *AXES), **extra)
    again = c.codebook_from_json(book.to_json())
    frame = c.encode_blocks(cache, torch.tensor([1, 0]), c.bind(again, layout, ref_src))
    assert frame.dtype == torch.uint8 and frame.dim() == 1
    assert frame.numel() <= c.capacity((2, *cache.shape[1:]), cache.dtype)
    assert codec.codec_of(frame).name in (name, "raw")  # a frame that would not shrink is stored
    out = torch.zeros(3, *cache.shape[1:], dtype=cache.dtype)
    c.decode_blocks(frame, out, torch.tensor([2, 0]), c.bind(again, layout, ref_dst))
    assert not out[1].view(torch.int16).any()  # a block not named was not written
    if c.lossless:
        assert bits_equal(out[2], cache[1]) and bits_equal(out[0], cache[0])
        if c.capabilities.standalone:  # plain tensors, no layout needed
            x = cache[0]
            assert bits_equal(c.decode(c.encode(x, again), again), x)
            into = torch.empty_like(x)
            c.decode(c.encode(x, again), again, out=into)
            assert bits_equal(into, x)
    else:
        assert not bits_equal(out[2], cache[1])
        assert bits_equal(out[[2, 0]], _through(c, c.bind(again, layout), cache[[1, 0]]))
        assert float((out[2].float() - cache[1].float()).norm() / cache[1].float().norm()) < 0.5


def _through(c, bound, blocks: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(blocks.shape[0])
    out = torch.zeros_like(blocks)
    c.decode_blocks(c.encode_blocks(blocks, ids, bound), out, ids, bound)
    return out


@pytest.mark.parametrize("name", codec.names())
def test_every_codec_implements_what_it_declares(name):
    """A declared capability comes with its code, and the base's fallbacks stand only where none
    is declared: ``learn`` for ``learns``, both ``start_*`` methods for ``starts_blocks``."""
    c = codec.get(name)
    caps = c.capabilities
    assert isinstance(caps, codec.Capabilities) and isinstance(c, codec.Codec) and c.lossless == caps.lossless
    own = lambda method: getattr(type(c), method) is not getattr(codec.CodecBase, method)  # noqa: E731
    assert own("learn") == caps.learns
    assert own("start_encode_blocks") == own("start_decode_blocks") == caps.starts_blocks
    assert not (caps.identity and not caps.lossless) and not (caps.standalone and caps.decode_needs_codebook)
    assert (c in codec.lossless()) == (caps.lossless and caps.standalone)


@pytest.mark.parametrize("name", codec.names())
def test_every_codec_refuses_block_ids_outside_the_cache_with_its_own_error(name, real_kv):
    """Past the end or negative (which numpy and torch would wrap around): ``BlockOutOfRange``,
    still an ``IndexError``, and nothing written."""
    c = codec.get(name)
    cache = _blocks(real_kv, 1)
    layout = codec.BlockLayout(tuple(cache.shape[1:]), AXES)
    extra, reference = {}, None
    if name == "predictive":
        k8v4 = codec.get("k8v4")
        reference = _through(k8v4, k8v4.bind(None, layout), cache)
        extra = {"predictor": reference}
    bound = c.bind(c.calibrate(cache, token_axis=4, axes=("block", *AXES), **extra), layout, reference)
    frame = c.encode_blocks(cache, torch.tensor([1, 0]), bound)
    for ids in ([2, 0], [0, -1]):
        with pytest.raises(codec.BlockOutOfRange):
            c.encode_blocks(cache, torch.tensor(ids), bound)
        out = torch.zeros_like(cache)
        with pytest.raises(codec.BlockOutOfRange):
            c.decode_blocks(frame, out, torch.tensor(ids), bound)
        assert not out.view(torch.int16).any()
    assert issubclass(codec.BlockOutOfRange, IndexError) and issubclass(codec.BlockOutOfRange, codec.CodecError)


def test_a_codec_without_a_capability_is_refused_or_waited_for():
    """The base's ``learn`` refuses; its ``start_*`` run the waiting calls and are done at once."""
    c = codec.get("k8v4")
    assert not c.capabilities.learns and not c.capabilities.starts_blocks
    cache = torch.randn(3, 2, 2, 8, 16).to(torch.bfloat16)
    layout = codec.BlockLayout(tuple(cache.shape[1:]), ("kv", "head", "token", "channel"))
    with pytest.raises(codec.CodecError, match="learns no codebook"):
        c.learn(cache, layout)
    bound = c.bind(None, layout)
    ids = torch.tensor([2, 0])
    pending = c.start_encode_blocks(cache, ids, bound)
    assert pending.ready() and torch.equal(pending.result(), c.encode_blocks(cache, ids, bound))
    out = torch.zeros_like(cache)
    assert c.start_decode_blocks(pending.result(), out, torch.tensor([0, 1]), bound).result() is None
    assert out[0].view(torch.int16).any() and not out[2].view(torch.int16).any()


def test_codec_of_rejects_garbage():
    with pytest.raises(codec.CorruptFrame):
        codec.codec_of(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(codec.CorruptFrame, match="magic"):
        codec.codec_of(torch.zeros(200, dtype=torch.uint8))
