"""NaN payloads, infinities, signed zeros, subnormals and every exponent value round-trip."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from kvferry.codec.format import FrameCodec
from kvferry.codec.frames import _encode
from tests.conftest import DTYPES, bits_equal


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("force", [None, FrameCodec.SPLITZIP], ids=["auto", "splitzip"])
def test_every_bit_pattern(dtype, force):
    """All 2**16 (or 2**8) patterns: every exponent, NaN payloads, +-Inf, -0, subnormals."""
    layout = codec.layout_for(dtype)
    patterns = torch.arange(1 << layout.total_bits, dtype=torch.int32)
    x = patterns.to(layout.int_dtype).view(dtype)
    frame = _encode(x, None, checksum=True, chunk=codec.DEFAULT_CHUNK, force=force)
    assert bits_equal(codec.decode(frame), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_specials_among_typical_values(dtype):
    """Rare specials in otherwise compressible data go through the escape path, not the book."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=gen).to(dtype)
    specials = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0], dtype=dtype)
    x[::997][: specials.numel()] = specials
    bits = x.view(torch.int16)
    bits[5] = 0x7FC1 if dtype == torch.bfloat16 else 0x7E01  # NaN with a payload
    bits[6] = 0x0001  # smallest subnormal
    bits[7] = -0x7FFF  # negative NaN-ish pattern 0x8001 -> negative subnormal
    book = codec.calibrate(torch.randn(4096, generator=gen).to(dtype))
    frame = codec.encode(x, book)
    header = codec.read_header(frame)
    assert header.codec == FrameCodec.SPLITZIP and header.escapes > 0
    y = codec.decode(frame)
    assert bits_equal(y, x)


def test_decode_into_out_of_other_shape():
    x = torch.randn(4, 256).to(torch.bfloat16)
    out = torch.empty(1024, dtype=torch.bfloat16)
    assert codec.decode(codec.encode(x), out=out) is out
    assert bits_equal(out.view(4, 256), x)


def test_decode_into_noncontiguous_out():
    x = torch.randn(64, 32).to(torch.float16)
    base = torch.zeros(32, 128, dtype=torch.float16)
    out = base[:, ::2].t()  # 64 x 32 view, non-contiguous
    codec.decode(codec.encode(x), out=out)
    assert torch.equal(out.contiguous().view(torch.int16), x.view(torch.int16))
    assert torch.count_nonzero(base[:, 1::2]) == 0


@pytest.mark.parametrize("bad", [torch.empty(1023, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.float16)],
                         ids=["numel", "dtype"])
def test_out_mismatch(bad):
    frame = codec.encode(torch.randn(1024).to(torch.bfloat16))
    with pytest.raises(codec.OutputMismatch):
        codec.decode(frame, out=bad)


def test_unsupported_inputs():
    with pytest.raises(codec.UnsupportedTensor):
        codec.encode(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(codec.UnsupportedTensor):
        codec.encode(torch.zeros([1] * 9, dtype=torch.bfloat16))
    with pytest.raises(codec.CodebookMismatch):
        codec.encode(torch.zeros(4, dtype=torch.float16), codec.calibrate(torch.zeros(4, dtype=torch.bfloat16)))
