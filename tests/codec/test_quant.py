"""k8v4 / k4v2 on the CPU reference: the quantizer against an independent numpy oracle of its
definition (kvferry/codec/quant/FORMAT.md), the error bound, refusals, golden bytes, corruption,
block gather/scatter, bind and capacity."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import codec
from kvferry.codec.checksum import crc32c
from kvferry.codec import quant
from kvferry.codec.quant import HEADER_SIZE, K4V2, K8V4, QuantLayout, quant_layout, read_header
from kvferry.codec.quant.format import Stream
from tests.conftest import bits_equal, from_bytes

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
CODECS = {"k8v4": K8V4, "k4v2": K4V2}
DTYPES = [torch.bfloat16, torch.float16]
AXES = ("layer", "kv", "token", "head", "channel")
U = 2.0 ** -24


def kv_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Vectors with very different ranges and offsets, as KV heads have."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 2)
    offset = torch.randn(*shape[:-1], 1, generator=g) * spread
    return (torch.randn(*shape, generator=g) * spread + offset).to(dtype)


def oracle(x: torch.Tensor, layout: QuantLayout, bits: tuple[int, int]) -> tuple[torch.Tensor, np.ndarray]:
    """The definition, element by element in numpy: reconstruction and per-vector scales [2, n]."""
    v = x.float().movedim((layout.kv_axis, layout.channel_axis), (0, -1))
    shape = v.shape
    v = v.reshape(2, -1, shape[-1]).numpy()
    out = np.empty_like(v)
    scales = np.empty(v.shape[:2], dtype=np.float32)
    for kind in (0, 1):
        levels = np.float32((1 << bits[kind]) - 1)
        for j, vec in enumerate(v[kind]):
            lo, hi = np.float32(vec.min()), np.float32(vec.max())
            lo = np.float32(0) if lo == 0 else lo
            z = np.float16(lo)
            if np.float32(z) > lo:
                z = np.nextafter(z, np.float16(-np.inf))
            d = max(np.float32(np.float32(hi - np.float32(z)) / levels), np.float32(U))
            s = np.float16(d)
            if np.float32(s) < d:
                s = np.nextafter(s, np.float16(np.inf))
            s32, z32 = np.float32(s), np.float32(z)
            r32 = np.float32(np.float32(1) / s32)
            q = np.clip(np.rint((vec - z32) * r32), 0, levels).astype(np.float32)
            out[kind, j] = np.clip(q * s32 + z32, -65504, 65504)
            scales[kind, j] = s32
    y = torch.from_numpy(out).view(shape).movedim((0, -1), (layout.kv_axis, layout.channel_axis))
    return y.to(x.dtype), scales


def half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Half the spacing of ``y``'s dtype at |y| (subnormals included)."""
    mant, emin = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}[y.dtype]
    a = y.float().abs()
    e = torch.floor(torch.log2(torch.clamp_min(a, 2.0 ** emin)))
    return torch.exp2(e - mant - 1)


def error_bound(x: torch.Tensor, y: torch.Tensor, layout: QuantLayout, scales: np.ndarray, bits) -> torch.Tensor:
    """FORMAT.md's bound, per element: s/2 + 4u·L·s + u·(|x| + s) + ulp(x')/2."""
    levels = torch.tensor([(1 << b) - 1 for b in bits], dtype=torch.float32)
    moved = list(x.movedim((layout.kv_axis, layout.channel_axis), (0, -1)).shape)
    s = torch.from_numpy(scales).view(*moved[:-1], 1).expand(*moved)
    lv = levels.view(2, *[1] * (len(moved) - 1)).expand(*moved)
    s, lv = (t.movedim((0, -1), (layout.kv_axis, layout.channel_axis)) for t in (s, lv))
    return s / 2 + 4 * U * lv * s + U * (x.float().abs() + s) + half_ulp(y)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_the_definition_and_obeys_the_bound(name, dtype):
    c = CODECS[name]
    layout = quant_layout(AXES)
    x = kv_like((3, 2, 9, 4, 64), dtype, seed=1)
    frame = c.encode(x, layout)
    y = c.decode(frame)
    expected, scales = oracle(x, layout, (c.k_bits, c.v_bits))
    assert bits_equal(y, expected)
    err = (y.float() - x.float()).abs()
    bound = error_bound(x, y, layout, scales, (c.k_bits, c.v_bits))
    assert (err <= bound).all()
    assert (err > bound / 4).any()  # the bound is not vacuous
    out = torch.full_like(x, 7)
    c.decode(frame, out=out)
    assert bits_equal(out, y)
    flat = torch.empty(x.numel(), dtype=dtype)
    c.decode(frame, out=flat)
    assert bits_equal(flat.view(x.shape), y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_kv_bound_and_k_beats_v(real_kv, dtype):
    k = torch.stack(real_kv["c1_k"][:6])  # [layers, heads, tokens, 64]
    v = torch.stack(real_kv["c1_v"][:6])
    x = torch.stack([k, v], 1).to(dtype)  # [layer, kv, head, token, channel]
    layout = QuantLayout(1, 4)
    for c in (K8V4, K4V2):
        y = c.decode(c.encode(x, layout))
        expected, scales = oracle(x, layout, (c.k_bits, c.v_bits))
        assert bits_equal(y, expected)
        err = (y.float() - x.float()).abs()
        assert (err <= error_bound(x, y, layout, scales, (c.k_bits, c.v_bits))).all()
        rel = [(err[:, i].mean() / x[:, i].float().abs().mean()).item() for i in (0, 1)]
        assert rel[0] < rel[1] / 2, rel  # K at twice V's bits
    r8, r4 = (x.numel() * 2 / c.encode(x.to(torch.bfloat16), layout).numel() for c in (K8V4, K4V2))
    assert abs(r8 - 256 / 104) < 0.01 and abs(r4 - 256 / 56) < 0.02


def test_constant_vectors():
    x = torch.zeros(2, 6, 8, dtype=torch.bfloat16)
    values = [0.0, -0.0, 1.5, -3.0, 65280.0, -65280.0]
    for j, value in enumerate(values):
        x[:, j] = value
    x[1, 0] = 1e-30  # below the fp16 range: reconstructed as 0, within half a step
    layout = QuantLayout(0, 2)
    for c in (K8V4, K4V2):
        y = c.decode(c.encode(x, layout))
        assert torch.equal(y[:, 1:].float(), x[:, 1:].float()) and torch.equal(y[0, 0].float(), x[0, 0].float())
        assert (y[1, 0] == 0).all()
        assert read_header(c.encode(x, layout)).vectors == 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 65536.0, -7e4])
def test_unrepresentable_values_are_refused(bad):
    x = kv_like((2, 3, 8), torch.bfloat16, seed=2)
    x[1, 2, 5] = bad
    for c in (K8V4, K4V2):
        with pytest.raises(codec.UnsupportedTensor, match="fp16 range"):
            c.encode(x, QuantLayout(0, 2))


def test_bad_tensors_and_layouts():
    x = kv_like((2, 3, 8), torch.bfloat16, seed=3)
    with pytest.raises(codec.UnsupportedTensor, match="bfloat16 or float16"):
        K8V4.encode(x.float(), QuantLayout(0, 2))
    with pytest.raises(codec.CodebookMismatch, match="QuantLayout"):
        K8V4.encode(x, None)
    with pytest.raises(codec.CodebookMismatch, match="not 2"):
        K8V4.encode(x, QuantLayout(1, 2))
    with pytest.raises(codec.CodebookMismatch, match="two different axes"):
        K8V4.encode(x, QuantLayout(0, 5))
    with pytest.raises(codec.UnsupportedTensor, match="whole bytes"):
        K4V2.encode(kv_like((2, 3, 6), torch.float16, seed=4), QuantLayout(0, 2))
    assert K8V4.encode(kv_like((2, 3, 6), torch.float16, seed=4), QuantLayout(0, 2)).numel() > 0


def test_layout_json_calibrate_and_registry_attributes(real_kv):
    for name, c in CODECS.items():
        assert codec.get(name) is c and not c.lossless and not c.capabilities.standalone and not c.capabilities.decode_needs_codebook
        assert c not in codec.lossless() and c.supports(torch.float16) and not c.supports(torch.float8_e5m2)
        book = c.calibrate(torch.zeros(1, 2, 3, 4, 64), axes=AXES)
        assert book == QuantLayout(1, 4) and c.codebook_from_json(book.to_json()) == book
        with pytest.raises(codec.CodebookMismatch, match="axes named"):
            c.calibrate(real_kv["c0_k"][:2], token_axis=1)
        with pytest.raises(codec.CodebookMismatch, match="kv"):
            c.calibrate(torch.zeros(3, 64), axes=("token", "channel"))
    for text in ("{", "[]", '{"format": "kvferry.quant.layout", "version": 2, "kv_axis": 0, "channel_axis": 1}',
                 '{"format": "kvferry.quant.layout", "version": 1, "kv_axis": 0, "channel_axis": 0}',
                 '{"format": "kvferry.quant.layout", "version": 1, "kv_axis": "0", "channel_axis": 1}',
                 '{"format": "kvferry.quant.layout", "version": 1, "kv_axis": 0, "channel_axis": 1, "x": 1}'):
        with pytest.raises(codec.CodebookMismatch):
            K8V4.codebook_from_json(text)


def test_bind():
    block = codec.BlockLayout((2, 16, 4, 64), ("kv", "token", "head", "channel"))
    assert K8V4.bind(None, block) == QuantLayout(0, 3)
    assert K4V2.bind(QuantLayout(1, 4), block) == QuantLayout(0, 3)
    for layout in (None, codec.BlockLayout((16, 4, 64), ("token", "head", "channel")),
                   codec.BlockLayout((2, 16, 64), ("kv", "token", "dim"))):
        with pytest.raises(codec.CodebookMismatch, match="k8v4"):
            K8V4.bind(None, layout)
    with pytest.raises(codec.CodebookMismatch, match="reference"):
        K8V4.bind(None, block, torch.zeros(1))
    with pytest.raises(codec.CodebookMismatch, match="whole bytes"):
        K4V2.bind(None, codec.BlockLayout((2, 16, 6), ("kv", "token", "channel")))
    with pytest.raises(codec.CodebookMismatch):
        K8V4.bind("a codebook", block)


@pytest.mark.parametrize("axes", [("kv", "token", "head", "channel"), ("token", "kv", "channel", "head"),
                                  ("channel", "head", "kv")])
def test_blocks_gather_and_scatter(axes):
    shape = {"kv": 2, "token": 5, "head": 3, "channel": 8}
    block = codec.BlockLayout(tuple(shape[a] for a in axes), axes)
    cache = kv_like((6, *block.shape), torch.bfloat16, seed=5)
    for c in CODECS.values():
        bound = c.bind(None, block)
        frame = c.encode_blocks(cache, torch.tensor([3, 0]), bound)
        assert torch.equal(frame, c.encode(cache[[3, 0]], bound.shifted(1)))
        blocks = c.decode(frame)
        target = torch.zeros_like(cache)
        c.decode_blocks(frame, target, torch.tensor([5, 1]), bound)
        assert bits_equal(target[5], blocks[0]) and bits_equal(target[1], blocks[1])
        assert not target[[0, 2, 3, 4]].view(torch.int16).any()
        with pytest.raises(codec.OutputMismatch, match="repeat"):
            c.decode_blocks(frame, target, torch.tensor([2, 2]), bound)
        with pytest.raises(codec.OutputMismatch):
            c.decode_blocks(frame, target, torch.tensor([2]), bound)
        with pytest.raises(codec.OutputMismatch):
            c.decode_blocks(frame, target.half(), torch.tensor([2, 4]), bound)
        with pytest.raises(codec.BlockOutOfRange):
            c.encode_blocks(cache, torch.tensor([6]), bound)
        with pytest.raises(codec.OutputMismatch):
            c.decode(frame, out=torch.empty(3, dtype=torch.bfloat16))


def test_capacity_is_exact():
    for shape, layout in (((2, 64), QuantLayout(0, 1)), ((3, 2, 7, 4, 64), QuantLayout(1, 4)),
                          ((5, 2, 1, 128), QuantLayout(1, 3)), ((2, 0, 64), QuantLayout(0, 2)),
                          ((8, 3, 2), QuantLayout(2, 0))):
        x = kv_like(shape, torch.float16, seed=6)
        for c in CODECS.values():
            frame = c.encode(x, layout)
            assert c.capacity(shape, x.dtype, layout) == frame.numel()
            assert c.capacity(shape, x.dtype) >= frame.numel()
    assert K8V4.capacity((2, 64), torch.bfloat16) == HEADER_SIZE + 64 + 32 + 8
    with pytest.raises(codec.UnsupportedTensor):
        K8V4.capacity((4, 3, 511, 64), torch.bfloat16)


# Golden frames: frozen inputs and bytes (tests/data/golden/k8v4_make_golden.py writes them).
GOLDEN_CASES = [(name, dtype) for name in CODECS for dtype in ("bfloat16", "float16")]


def golden_input(dtype: str) -> torch.Tensor:
    x = from_bytes((GOLDEN / "k8v4_input.bfloat16.bin").read_bytes(), torch.bfloat16).view(2, 3, 16, 64)
    return x.to(getattr(torch, dtype))


@pytest.mark.parametrize("name,dtype", GOLDEN_CASES)
def test_golden_frames(name, dtype):
    c = CODECS[name]
    x = golden_input(dtype)
    golden = (GOLDEN / f"k8v4_frame.{name}.{dtype}.bin").read_bytes()
    frame = quant.encode(x, QuantLayout(0, 3), c.frame_id)  # the module's frame: with the stream CRC
    assert frame.numpy().tobytes() == golden
    assert read_header(c.encode(x, QuantLayout(0, 3))).stream_crc is None  # the registry entry's: without
    y = c.decode(torch.frombuffer(bytearray(golden), dtype=torch.uint8))
    assert bits_equal(y, oracle(x, QuantLayout(0, 3), (c.k_bits, c.v_bits))[0])
    assert golden[:7] == b"KVFZ\x01\x00" + bytes([c.frame_id])
    h = read_header(frame)
    assert (h.kv_axis, h.channel_axis, h.shape, h.bits) == (0, 3, (2, 3, 16, 64), (c.k_bits, c.v_bits))
    assert h.stream_crc is not None and all(o % 16 == 0 for o in h.offsets)


# Corruption: every header field, truncation, and each stream.
FIELDS = {"magic": (0, 4), "version": (4, 2), "codec": (6, 1), "dtype": (7, 1), "ndim": (8, 1), "kv": (9, 1),
          "channel": (10, 1), "kbits": (11, 1), "vbits": (12, 1), "flags": (13, 1), "reserved": (14, 2),
          "shape0": (16, 8), "shape3": (40, 8), "shape7": (72, 8), "len_k": (80, 8), "len_v": (88, 8),
          "len_p": (96, 8), "stream_crc": (104, 4)}


def _frame(checksum: bool = True) -> torch.Tensor:
    """A one-block frame, as ``decode_blocks`` into ``_cache()`` takes it."""
    from kvferry.codec.quant import encode_blocks
    cache = kv_like((3, 2, 3, 7, 64), torch.bfloat16, seed=7)
    return encode_blocks(cache, [1], QuantLayout(0, 3), 3, checksum=checksum)


def _recrc(buf: bytearray) -> torch.Tensor:
    buf[108:112] = struct.pack("<I", crc32c(bytes(buf[:108])))
    return torch.frombuffer(buf, dtype=torch.uint8)


def _assert_refused(frame: torch.Tensor) -> None:
    """Both decoders raise CorruptFrame, and the cache is untouched."""
    cache = torch.ones(4, 2, 3, 7, 64, dtype=torch.bfloat16)
    with pytest.raises(codec.CorruptFrame):
        K8V4.decode(frame)
    with pytest.raises(codec.CorruptFrame):
        K8V4.decode_blocks(frame, cache, torch.tensor([2]))
    assert (cache == 1).all()


def test_intact_frame_is_accepted():
    cache = torch.ones(4, 2, 3, 7, 64, dtype=torch.bfloat16)
    K8V4.decode_blocks(_frame(), cache, torch.tensor([2]))
    assert not (cache[2] == 1).all() and (cache[[0, 1, 3]] == 1).all()


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("recrc", [False, True], ids=["crc", "recrc"])
def test_every_header_field(field, recrc):
    offset, size = FIELDS[field]
    buf = bytearray(_frame().numpy().tobytes())
    buf[offset + size - 1] ^= 0x40
    _assert_refused(_recrc(buf) if recrc else torch.frombuffer(buf, dtype=torch.uint8))


def test_stream_crc_without_its_flag():
    buf = bytearray(_frame(checksum=False).numpy().tobytes())
    buf[104] = 1
    _assert_refused(_recrc(buf))


def test_truncation_and_extension():
    frame = _frame()
    for n in (0, 6, 111, 112, frame.numel() - 1):
        _assert_refused(frame[:n].clone())
    _assert_refused(torch.cat([frame, torch.zeros(1, dtype=torch.uint8)]))
    _assert_refused(torch.cat([frame, torch.zeros(16, dtype=torch.uint8)]))


def test_bit_flips_in_each_stream():
    frame = _frame()
    h = read_header(frame)
    for stream in (Stream.K, Stream.V, Stream.PARAMS):
        for pos in (h.offsets[stream], h.offsets[stream] + h.lengths[stream] - 1):
            bad = frame.clone()
            bad[pos] ^= 0x10
            _assert_refused(bad)


def test_checks_without_stream_crc():
    """Padding and parameters are still checked (every code value is legal)."""
    frame = _frame(checksum=False)
    h = read_header(frame)
    p = h.offsets[Stream.PARAMS]
    for pos, value in ((p + 1, 0x7C), (p + 1, 0x80), (p + 3, 0xFC), (p + 5, 0x7F)):  # inf, -, NaN zero, NaN
        bad = frame.clone()
        bad[pos] = value
        _assert_refused(bad)
    bad = frame.clone()
    bad[p:p + 2] = 0  # scale 0
    _assert_refused(bad)
    from kvferry.codec.quant import encode
    frame = encode(kv_like((2, 3, 6), torch.bfloat16, seed=9), QuantLayout(0, 2), 3, checksum=False)
    h = read_header(frame)
    pad = h.offsets[Stream.K] + h.lengths[Stream.K]
    assert pad < h.offsets[Stream.V]  # 3 vectors of 6 bytes: K is padded
    K8V4.decode(frame)
    bad = frame.clone()
    bad[pad] = 1
    with pytest.raises(codec.CorruptFrame, match="padding"):
        K8V4.decode(bad)


def test_frames_name_their_codec():
    x = kv_like((2, 4, 64), torch.float16, seed=8)
    for c in CODECS.values():
        frame = c.encode(x, QuantLayout(0, 2))
        assert codec.codec_of(frame) is c
    with pytest.raises(codec.CorruptFrame):
        K8V4.decode(K4V2.encode(x, QuantLayout(0, 2)))
