"""The tca-tbe codec on the CPU reference: bit-exact round trips (every BF16 pattern, special
values, real KV), its ratio beside SplitZip's, golden bytes, and corrupt frames that raise
CorruptFrame with nothing written."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvferry import codec
from kvferry.codec import tcatbe
from kvferry.codec.checksum import crc32c
from kvferry.codec.tcatbe import reference
from kvferry.codec.tcatbe.codec import assemble, decode_reference, finish
from kvferry.codec.tcatbe.format import (GROUP_TILES, HEADER_SIZE, Stream, frame_size, make_header,
                                         padding_ranges)
from tests.conftest import DATA, bits_equal, from_bytes

GOLDEN = DATA / "golden"
ALL_PATTERNS = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)


def bf16(bits) -> torch.Tensor:
    return torch.as_tensor(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def kv_like(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.7).to(torch.bfloat16)


def coded(x: torch.Tensor, checksum: bool = True) -> torch.Tensor:
    """A tca-tbe frame of ``x`` even where a stored frame would be smaller."""
    bits = x.contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    low, in_window, streams = reference.encode_streams(bits)
    return assemble(make_header(1, tuple(x.shape), low, in_window), streams, checksum)


def round_trip(x: torch.Tensor, frame: torch.Tensor | None = None) -> torch.Tensor:
    frame = tcatbe.encode(x) if frame is None else frame
    assert bits_equal(tcatbe.decode(frame), x)
    out = torch.full_like(x, 3.0)
    tcatbe.decode(frame, out=out)
    assert bits_equal(out, x)
    return frame


def test_every_bf16_pattern_round_trips_coded_and_stored():
    patterns = ALL_PATTERNS[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(1))]
    x = patterns.view(torch.bfloat16)
    frame = round_trip(x)  # 7 of 256 exponents in the window: storing wins
    assert frame[6].item() == int(codec.FrameCodec.STORED)
    frame = round_trip(x, coded(x))  # the coded path, forced, for every pattern
    assert tcatbe.read_header(frame).in_window == 7 * 256
    # Every pattern among KV: a coded frame over three groups of 1024 tiles, last tile partial.
    kv = kv_like(3 * 65536 + 77)
    x = torch.cat([kv[:70000], x, kv[70000:]]).view(3, -1)
    frame = round_trip(x)
    header = tcatbe.read_header(frame)
    assert frame[6].item() == tcatbe.FRAME_ID and header.tiles > 2 * GROUP_TILES and header.numel % 64


def test_random_bits_round_trip():
    g = torch.Generator().manual_seed(2)
    for n in (0, 1, 63, 64, 65, 4096, 100_003):
        x = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=g).view(torch.bfloat16)
        round_trip(x)
        round_trip(x, coded(x))


@pytest.mark.parametrize("shape", [(), (1,), (7, 9), (2, 3, 64), (4, 1, 129), (2, 1, 1, 1, 1, 1, 1, 3)])
def test_shapes(shape):
    x = kv_like(int(np.prod(shape)), seed=3).view(shape)
    round_trip(x, coded(x))
    round_trip(x)


def test_special_values():
    specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF, 0x7FFF,
                0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
    body = kv_like(4096, seed=4).view(torch.int16).numpy().view(np.uint16).copy()
    body[::37] = np.resize(np.array(specials, dtype=np.uint16), body[::37].size)
    x = bf16(body)
    frame = round_trip(x)
    assert frame[6].item() == tcatbe.FRAME_ID
    assert tcatbe.read_header(frame).fallback >= len(specials) - 2
    # Windows at both ends of the exponent range: zeros and subnormals coded, or Inf/NaN coded.
    low = bf16([0x0000, 0x8000, 0x0001, 0x80FF, 0x0300, 0x037F] * 50 + [0x3F80])
    assert tcatbe.read_header(round_trip(low, coded(low))).window_low == 0
    high = bf16([0x7F80, 0xFFC1, 0x7FFF, 0x7C00, 0xFE7F] * 50 + [0x3F80])
    assert tcatbe.read_header(round_trip(high, coded(high))).window_low == 249


def test_window_choice():
    hist = np.zeros(256, dtype=np.int64)
    hist[[10, 11, 12, 100, 101]] = [5, 5, 5, 4, 4]
    assert reference.choose_window(hist) == 6  # windows 6..10 all cover 15: the first wins
    hist[[102, 103]] = 4
    assert reference.choose_window(hist) == 97  # 16 elements in exponents 100..103
    assert reference.choose_window(np.zeros(256, dtype=np.int64)) == 0


def test_constant_time_addressing_matches_decode():
    x = torch.cat([kv_like(2 * 65536 + 300, seed=5), ALL_PATTERNS.view(torch.bfloat16)])
    frame = coded(x, checksum=False)
    header = tcatbe.read_header(frame)
    buf = frame.numpy()
    streams = [buf[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    bits = x.view(torch.int16).numpy().view(np.uint16)
    rng = np.random.default_rng(6)
    picks = np.concatenate([rng.integers(0, x.numel(), 400), [0, 63, 64, 65535, 65536, 65600, x.numel() - 1]])
    for i in picks:
        assert reference.decode_element(header, streams, int(i)) == int(bits[i]), i


def test_header_and_sizes():
    x = kv_like(1000, seed=7).view(10, 100)
    frame = tcatbe.encode(x)
    h = tcatbe.read_header(frame)
    assert (h.shape, h.numel, h.in_window + h.fallback) == ((10, 100), 1000, 1000)
    assert frame.numel() == h.total == frame_size(1000, h.in_window)
    assert all(o % 16 == 0 for o in h.offsets) and h.offsets[0] == HEADER_SIZE
    c = codec.get("tca-tbe")
    assert frame.numel() <= c.capacity(x.shape, x.dtype)
    assert c.lossless and c.capabilities.standalone and c.frame_id == 6 and codec.codec_of(frame) is c


def test_capacity_covers_every_frame():
    c = codec.get("tca-tbe")
    g = torch.Generator().manual_seed(8)
    for n in (0, 1, 5, 64, 1000, 70000):
        for x in (kv_like(n, seed=n), torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16,
                                                      generator=g).view(torch.bfloat16)):
            assert c.encode(x).numel() <= c.capacity(x.shape, x.dtype)


def test_registry_entry_and_codebook():
    c = codec.get("tca-tbe")
    assert "tca-tbe" in codec.names() and c in codec.lossless()
    assert c.supports(torch.bfloat16) and not c.supports(torch.float16) and not c.supports(torch.float8_e4m3fn)
    book = c.codebook_from_json(c.calibrate([kv_like(100)], axes=("block", "channel")).to_json())
    assert c.bind(book, None) is book
    with pytest.raises(codec.CodebookMismatch):
        c.codebook_from_json('{"format": "kvferry-codebook", "codec": "raw"}')
    with pytest.raises(codec.CodebookMismatch):
        c.encode(kv_like(64), codec.get("raw").calibrate(None))
    with pytest.raises(codec.CodebookMismatch):
        c.bind(book, None, reference=torch.zeros(1))
    with pytest.raises(codec.UnsupportedTensor):
        c.encode(torch.zeros(64, dtype=torch.float16))
    with pytest.raises(codec.UnsupportedTensor):
        c.capacity((64,), torch.float32)


def test_real_kv_ratio_beside_splitzip(real_kv):
    tca, sz = codec.get("tca-tbe"), codec.get("splitzip")
    sz_book = sz.calibrate(real_kv["c0"], token_axis=1)
    raw = tca_bytes = sz_bytes = 0
    for x in real_kv["c1"]:
        frame = tca.encode(x)
        assert bits_equal(tca.decode(frame), x)
        raw += x.numel() * 2
        tca_bytes += frame.numel()
        sz_bytes += sz.encode(x, sz_book).numel()
    stacked = torch.stack(real_kv["c1"])
    stacked_frame = tca.encode(stacked)
    assert bits_equal(tca.decode(stacked_frame), stacked)
    ratio, sz_ratio, stacked_ratio = raw / tca_bytes, raw / sz_bytes, raw / stacked_frame.numel()
    print(f"\nreal KV (60 tensors of [3, 511, 64]): tca-tbe {ratio:.3f} per tensor, {stacked_ratio:.3f} "
          f"as one frame; splitzip {sz_ratio:.3f}")
    assert 1.33 < ratio < 1.45 and 1.30 < stacked_ratio < ratio
    assert ratio > sz_ratio - 0.05  # measured: tca-tbe 1.37 per tensor, splitzip 1.33


@pytest.mark.parametrize("name", ["bfloat16", "bfloat16_tail"])
def test_golden_frames(name):
    raw = (GOLDEN / f"tcatbe_{name}.input.bin").read_bytes()
    golden = (GOLDEN / f"tcatbe_{name}.frame.bin").read_bytes()
    header = tcatbe.read_header(torch.frombuffer(bytearray(golden), dtype=torch.uint8))
    x = from_bytes(raw, torch.bfloat16).view(header.shape)
    frame = tcatbe.encode(x, checksum=header.stream_crc is not None)
    assert frame.numpy().tobytes() == golden, "encoder bytes changed: bump TCATBE_VERSION if on purpose"
    assert bits_equal(tcatbe.decode(torch.frombuffer(bytearray(golden), dtype=torch.uint8)), x)


# --- corrupt frames -------------------------------------------------------------------------

def sample(checksum: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """KV with specials over two groups of tiles, last tile partial: every stream non-empty."""
    x = torch.cat([kv_like(65_999, seed=9), ALL_PATTERNS[::64].view(torch.bfloat16)]).view(-1, 3)
    frame = tcatbe.encode(x, checksum=checksum)
    assert frame[6].item() == tcatbe.FRAME_ID and all(tcatbe.read_header(frame).lengths)
    return x, frame


def rewrite_header(frame: torch.Tensor, offset: int, fmt: str, value: int) -> torch.Tensor:
    """The frame with one header field changed and the header CRC made right again."""
    buf = bytearray(frame.numpy().tobytes())
    struct.pack_into(fmt, buf, offset, value)
    struct.pack_into("<I", buf, HEADER_SIZE - 4, crc32c(bytes(buf[:HEADER_SIZE - 4])))
    return torch.frombuffer(buf, dtype=torch.uint8)


def restream(frame: torch.Tensor, stream: int, index: int, fmt: str, value: int) -> torch.Tensor:
    """The frame with one stream entry changed and both CRCs made right again: only the
    consistency checks can catch it."""
    header = tcatbe.read_header(frame)
    buf = bytearray(frame.numpy().tobytes())
    struct.pack_into(fmt, buf, header.offsets[stream] + index * struct.calcsize(fmt), value)
    out = torch.frombuffer(buf, dtype=torch.uint8)
    return finish(out, header.with_crc(None) if header.stream_crc is None else header, header.stream_crc is not None)


def assert_rejected(frame: torch.Tensor, match: str | None = None) -> None:
    sentinel = torch.full((22341, 3), 7.0, dtype=torch.bfloat16)  # sample()'s shape
    before = sentinel.clone()
    with pytest.raises(codec.CorruptFrame, match=match):
        tcatbe.decode(frame, out=sentinel)
    assert bits_equal(sentinel, before)


def test_header_fields_rejected():
    x, frame = sample()
    for i in range(HEADER_SIZE):  # any flipped header bit: the header CRC, magic or codec id
        bad = frame.clone()
        bad[i] ^= 1 << (i % 8)
        assert_rejected(bad)
    fields = [(4, "<H", 2, "version"), (6, "<B", 7, "codec id|not a tca-tbe"), (7, "<B", 2, "dtype"),
              (7, "<B", 99, "dtype"), (8, "<B", 9, "rank"), (8, "<B", 1, "rank"), (9, "<B", 250, "window"),
              (10, "<B", 2, "flags"), (11, "<B", 1, "reserved"), (12, "<Q", 67022, "shape"),
              (20, "<Q", 22340, "shape"), (36, "<Q", 1, "rank"), (84, "<Q", 1, "fallback"), (92, "<Q", 5, "fallback"),
              (100, "<I", 1, "reserved")]
    for offset, fmt, value, match in fields:
        assert_rejected(rewrite_header(frame, offset, fmt, value), match)
    h = tcatbe.read_header(frame)
    moved = rewrite_header(rewrite_header(frame, 84, "<Q", h.in_window - 16), 92, "<Q", h.fallback + 16)
    assert_rejected(moved, "frame is")  # counts that describe another size


def test_truncated_and_extended_rejected():
    _, frame = sample()
    for n in (0, 3, 6, 7, 50, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 17, frame.numel() // 2, frame.numel() - 1):
        with pytest.raises(codec.CorruptFrame):
            tcatbe.decode(frame[:n].clone())
    with pytest.raises(codec.CorruptFrame, match="frame is"):
        tcatbe.decode(torch.cat([frame, torch.zeros(16, dtype=torch.uint8)]))
    with pytest.raises(codec.CorruptFrame):
        tcatbe.decode(frame.view(2, -1) if frame.numel() % 2 == 0 else frame[None])
    with pytest.raises(codec.CorruptFrame):
        tcatbe.decode(frame.to(torch.int8))


def test_bit_flips_in_every_stream_fail_the_checksum():
    _, frame = sample(checksum=True)
    header = tcatbe.read_header(frame)
    for stream, (offset, length) in enumerate(zip(header.offsets, header.lengths)):
        for pos in (offset, offset + length // 2, offset + length - 1):
            bad = frame.clone()
            bad[pos] ^= 0x10
            assert_rejected(bad, "stream checksum")


@pytest.mark.parametrize("checksum", [True, False])
def test_bad_offsets_and_bitmaps_rejected(checksum):
    x, frame = sample(checksum)
    h = tcatbe.read_header(frame)
    cases = [
        (Stream.TILES, 5, "<H", 0, "tile offsets"),
        (Stream.TILES, 1, "<H", 1, "tile offsets"),
        (Stream.TILES, h.tiles - 1, "<H", 0xFFFF, "tile offsets"),
        (Stream.TILES, GROUP_TILES, "<H", 3, "tile offsets"),  # a group's first tile must be 0
        (Stream.GROUPS, 1, "<Q", 1 << 40, "group offsets"),  # far out of bounds
        (Stream.GROUPS, 0, "<Q", 64, "group offsets"),
        (Stream.BITMAPS, 3 * 7, "<Q", 0, "offsets|bitmaps"),  # tile 7 all fallback: counts move
        (Stream.BITMAPS, 3 * (h.tiles - 1) + 2, "<Q", 1 << 63, "past the end"),  # a code in a padding slot
    ]
    for stream, index, fmt, value, match in cases:
        assert_rejected(restream(frame, stream, index, fmt, value), match)
    # Non-zero padding between streams.
    gaps = padding_ranges(h)
    assert gaps
    bad = frame.clone()
    bad[gaps[0][0]] = 1
    assert_rejected(finish(bad, h, checksum) if checksum else bad, "padding")


def test_random_corruption_never_escapes():
    """Without a stream CRC, flipped bytes either decode (wrong values, right shape) or raise
    CorruptFrame: nothing else, nothing out of bounds."""
    x, frame = sample(checksum=False)
    rng = np.random.default_rng(10)
    for _ in range(150):
        bad = frame.clone()
        for pos in rng.integers(HEADER_SIZE, frame.numel(), int(rng.integers(1, 4))):
            bad[int(pos)] ^= int(rng.integers(1, 256))
        try:
            y = tcatbe.decode(bad)
        except codec.CorruptFrame:
            continue
        assert y.shape == x.shape and y.dtype == x.dtype


def test_stored_frames_of_other_codecs_and_ids():
    x = kv_like(256).view(4, 64)
    assert bits_equal(tcatbe.decode(codec.encode_stored(x)), x)
    with pytest.raises(codec.CorruptFrame, match="not a tca-tbe"):
        tcatbe.decode(codec.get("splitzip").encode(x))


# --- blocks -----------------------------------------------------------------------------------

def test_blocks_round_trip_and_mismatches():
    c = codec.get("tca-tbe")
    cache = kv_like(8 * 2 * 300, seed=11).view(8, 2, 300)
    ids = torch.tensor([6, 1, 3])
    frame = c.encode_blocks(cache, ids)
    assert torch.equal(frame, c.encode(cache[ids]))
    assert tcatbe.read_header(frame).stream_crc is None  # the engine's frames: the transport checks payloads
    frame = tcatbe.encode_blocks(cache, ids)  # the module's: with the stream CRC, so a flipped bit is caught
    target = torch.zeros_like(cache)
    c.decode_blocks(frame, target, torch.tensor([0, 4, 7]))
    assert bits_equal(target[[0, 4, 7]], cache[ids]) and not target[[1, 2, 3, 5, 6]].view(torch.int16).any()
    before = target.clone()
    with pytest.raises(codec.OutputMismatch):
        c.decode_blocks(frame, torch.zeros(8, 2, 301, dtype=torch.bfloat16), torch.tensor([0, 4, 7]))
    with pytest.raises(codec.OutputMismatch):
        c.decode_blocks(frame, torch.zeros(8, 2, 300, dtype=torch.float16), torch.tensor([0, 4, 7]))
    with pytest.raises(codec.OutputMismatch):
        c.decode_blocks(frame, target, torch.tensor([0, 4]))
    with pytest.raises(codec.OutputMismatch):
        c.decode_blocks(frame, target, torch.tensor([0, 4, 4]))
    with pytest.raises(codec.BlockOutOfRange):
        c.decode_blocks(frame, target, torch.tensor([0, 4, 8]))
    with pytest.raises(codec.BlockOutOfRange):
        c.encode_blocks(cache, torch.tensor([8]))
    bad = frame.clone()
    bad[-1] ^= 1
    with pytest.raises(codec.CorruptFrame):
        c.decode_blocks(bad, target, torch.tensor([2, 5, 6]))
    assert bits_equal(target, before)  # nothing written by any failure


def test_decode_reference_is_what_decode_uses():
    x, frame = sample(checksum=False)
    y = decode_reference(frame.numpy(), tcatbe.read_header(frame))
    assert bits_equal(y, x)
