"""Arbitrary bit patterns round-trip bit-exactly for every dtype, coded or stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import codec
from kvferry.codec.format import FrameCodec
from kvferry.codec.frames import _encode
from tests.conftest import DTYPES, bits_equal, from_bytes

CHUNK = codec.DEFAULT_CHUNK
sizes = st.integers(min_value=0, max_value=3 * CHUNK + 7)


@st.composite
def tensors(draw, dtype: torch.dtype, escape_heavy: bool = False) -> torch.Tensor:
    """Bits that are either fully random or mostly a few exponents with a sprinkling of escapes."""
    n = draw(sizes)
    width = torch.empty((), dtype=dtype).element_size()
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=gen)
    x = raw.view(dtype)
    if draw(st.booleans()) or escape_heavy:
        # Pull most exponents into a narrow band so the codebook covers them; keep the rest random.
        layout = codec.layout_for(dtype)
        bits = x.view(layout.int_dtype).to(torch.int32)
        band = torch.randint(0, 6, (n,), generator=gen, dtype=torch.int32) + (1 << (layout.exp_bits - 1)) - 3
        keep_random = torch.rand(n, generator=gen) < draw(st.sampled_from([0.0, 0.01, 0.2, 0.9]))
        m = layout.mant_bits
        emask = ((1 << layout.exp_bits) - 1) << m
        banded = (bits & ~emask) | (band << m)
        bits = torch.where(keep_random, bits, banded)
        x = bits.to(layout.int_dtype).view(dtype) if layout.total_bits == 16 else bits.to(torch.uint8).view(dtype)
    shape = draw(st.sampled_from(["flat", "2d", "scalar"]))
    if shape == "2d" and n % 3 == 0 and n:
        x = x.view(3, -1)
    elif shape == "scalar" and n == 1:
        x = x.view(())
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_roundtrip_without_codebook(dtype, data):
    x = data.draw(tensors(dtype))
    frame = codec.encode(x)
    assert frame.numel() <= codec.HEADER_SIZE + x.numel() * x.element_size()
    assert bits_equal(codec.decode(frame), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_roundtrip_with_foreign_codebook(dtype, data):
    """A codebook calibrated on other data: exponents it misses become escapes."""
    x = data.draw(tensors(dtype))
    other = data.draw(tensors(dtype))
    book = codec.calibrate([other]) if other.numel() else codec.calibrate([x.reshape(-1)[:0]])
    assert bits_equal(codec.decode(codec.encode(x, book)), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), chunk=st.sampled_from([1, 7, 64, 1024, 65535]))
def test_forced_splitzip_escape_heavy(dtype, data, chunk):
    """The coded path itself, even where a stored frame would win (escape-heavy, random)."""
    x = data.draw(tensors(dtype, escape_heavy=True))
    frame = _encode(x, None, checksum=data.draw(st.booleans()), chunk=chunk, force=FrameCodec.SPLITZIP)
    assert codec.read_header(frame).codec == FrameCodec.SPLITZIP
    assert bits_equal(codec.decode(frame), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_escapes_roundtrip(dtype):
    """Every element escapes: a codebook that covers none of the data."""
    layout = codec.layout_for(dtype)
    exps = list(range(1 << layout.exp_bits))
    book = codec.Codebook(layout.name, tuple(exps[-layout.codebook_size:]))
    n = 2 * CHUNK + 5
    m = layout.mant_bits
    bits = (torch.arange(n) % (1 << m)) | ((torch.arange(n) % 3) << m)  # exponents 0..2, not in book
    x = bits.to(layout.int_dtype).view(dtype)
    frame = _encode(x, book, checksum=False, chunk=CHUNK, force=FrameCodec.SPLITZIP)
    assert codec.read_header(frame).escapes == n
    assert bits_equal(codec.decode(frame), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_tensor(dtype):
    for shape in [(0,), (4, 0, 3)]:
        x = torch.empty(shape, dtype=dtype)
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and y.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stored_when_incompressible(dtype):
    x = from_bytes(bytes(range(256)) * 40, dtype)
    frame = codec.encode(x)
    assert codec.read_header(frame).codec == FrameCodec.STORED
    assert frame.numel() == codec.HEADER_SIZE + x.numel() * x.element_size()
    assert bits_equal(codec.decode(frame), x)
