"""The lowrank codec: deterministic calibration, the exact arithmetic, error against energy on
real KV, binding refusals, codebook digests, golden frames and corrupt frames."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import codec
from kvferry.codec import lowrank
from kvferry.codec.layout import BlockLayout
from kvferry.codec.lowrank import reference
from kvferry.codec.lowrank.format import _BODY
from tests.conftest import bits_equal

AXES = ("layer", "kv", "head", "token", "channel")
GOLDEN = Path(__file__).parents[1] / "data" / "golden"


def kv_chunk(real_kv, chunk: int, layers: int = 30) -> torch.Tensor:
    """[layer, kv, head, token, channel] bf16 of one chunk of the real SmolLM2 KV."""
    return torch.stack([torch.stack([real_kv[f"c{chunk}_k"][i], real_kv[f"c{chunk}_v"][i]]) for i in range(layers)])


def as_blocks(x: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
    """[layer, kv, head, token, channel] -> blocks [n, layer, kv, head, tokens_per_block, channel]."""
    L, K, H, T, D = x.shape
    n = T // tokens_per_block
    return x[:, :, :, :n * tokens_per_block].reshape(L, K, H, n, tokens_per_block, D).permute(3, 0, 1, 2, 4, 5) \
        .contiguous()


@pytest.fixture(scope="module")
def chunks(real_kv):
    return kv_chunk(real_kv, 0, 4), kv_chunk(real_kv, 1, 4)


@pytest.fixture(scope="module")
def book(chunks):
    return lowrank.calibrate(chunks[0], axes=AXES, energy=0.99)


def bound_for(book, blocks):
    return lowrank.bind(book, BlockLayout(tuple(blocks.shape[1:]), AXES))


def rel_error(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.float() - x.float()).pow(2).sum().sqrt() / x.float().pow(2).sum().sqrt())


# --- calibration ---------------------------------------------------------------------------

def test_calibration_is_deterministic_and_json_round_trips(chunks):
    a = lowrank.calibrate(chunks[0], axes=AXES, energy=0.95)
    b = lowrank.calibrate(chunks[0].clone(), axes=AXES, energy=0.95)
    assert a.to_json() == b.to_json() and a.digest() == b.digest()
    again = codec.get("lowrank").codebook_from_json(a.to_json())
    assert again.to_json() == a.to_json() and again.digest() == a.digest()
    assert np.array_equal(again.rotations, a.rotations) and np.array_equal(again.ranks, a.ranks)
    doc = json.loads(a.to_json())
    assert doc["format"] == "kvferry-lowrank-codebook" and doc["version"] == 1
    assert doc["dims"] == {"layers": 4, "kv": 2, "heads": 3, "channels": 64}


def test_rotations_are_orthonormal_with_fixed_signs(book):
    r = book.rotations.astype(np.float64)
    eye = np.broadcast_to(np.eye(64), r.shape)
    assert np.abs(np.matmul(r.transpose(0, 2, 1), r) - eye).max() < 1e-5
    lead = np.argmax(np.abs(r), axis=1)  # each column's largest entry is positive
    assert (np.take_along_axis(r, lead[:, None, :], axis=1) > 0).all()


def test_energy_picks_the_smallest_rank_keeping_it(chunks):
    x = chunks[0]
    for energy in (0.5, 0.9, 0.99):
        b = lowrank.calibrate(x, axes=AXES, energy=energy)
        for g, (layer, kv, head) in enumerate([(0, 0, 0), (1, 1, 2), (3, 1, 1)]):
            g = (layer * 2 + kv) * 3 + head
            v = x[layer, kv, head].double().numpy()
            dev = v - v.mean(axis=0)
            ev = np.sort(np.linalg.eigvalsh(dev.T @ dev))[::-1]
            kept = np.cumsum(ev) / ev.sum()
            r = int(b.ranks[g])
            assert kept[r - 1] >= energy - 1e-9 and (r == 1 or kept[r - 2] < energy + 1e-9), (energy, g, r)
            assert b.captured[g] == pytest.approx(kept[r - 1], abs=1e-5)


def test_rank_budget_spends_exactly_the_budget_on_the_largest_eigenvalues(chunks):
    b = lowrank.calibrate(chunks[0], axes=AXES, rank_budget=500)
    assert int(b.ranks.sum()) == 500 and b.selection == {"rank_budget": 500}
    high_energy = lowrank.calibrate(chunks[0], axes=AXES, rank_budget=1000)
    assert (high_energy.ranks >= b.ranks).all()
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate(chunks[0], axes=AXES, rank_budget=24 * 64 + 1)


def test_calibration_refuses_bad_input(chunks):
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate(chunks[0], axes=("layer", "kv", "head", "token"), energy=0.9)  # 4 names, 5 dims
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate(chunks[0], axes=("layer", "kv", "head", "token", "x"))  # no channel
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate(chunks[0], axes=AXES, energy=0.0)
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate(chunks[0], axes=AXES, quantize="k4v2")
    with pytest.raises(codec.CodebookMismatch):
        lowrank.calibrate([], axes=AXES)


def test_layout_without_layer_axis_is_one_layer(chunks):
    x = chunks[0][2]  # [kv, head, token, channel] of layer 2
    one = lowrank.calibrate(x, axes=("kv", "head", "token", "channel"), energy=0.9)
    assert one.dims == (1, 2, 3, 64)
    full = lowrank.calibrate(chunks[0], axes=AXES, energy=0.9)
    assert np.array_equal(full.layer(2).rotations, one.rotations) and np.array_equal(full.layer(2).ranks, one.ranks)
    blocks = x[:, :, :64].reshape(2, 3, 4, 16, 64).permute(2, 0, 1, 3, 4).contiguous()
    bound = lowrank.bind(one, BlockLayout(tuple(blocks.shape[1:]), ("kv", "head", "token", "channel")))
    y = lowrank.decode(lowrank.encode(blocks, bound), bound)
    assert rel_error(y, blocks) < 0.5


# --- the arithmetic ------------------------------------------------------------------------

def _scalar_reference(xg: np.ndarray, book, quantize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The FORMAT.md arithmetic written out with numpy float32 scalars, one operation at a time:
    the float32 coefficients (zero past each rank) and the float32 reconstruction."""
    f32 = np.float32
    g_n, m_n, d = xg.shape
    out = np.zeros(xg.shape, dtype=np.float32)
    coefs = np.zeros((g_n, m_n, int(book.ranks.max())), dtype=np.float32)
    for g in range(g_n):
        r = int(book.ranks[g])
        R, mu = book.rotations[g], book.means[g]
        qmax = f32(15 if (quantize and (g // book.dims[2]) % book.dims[1] == 1) else 255)
        for m in range(m_n):
            c = []
            for k in range(r):
                acc = f32(0)
                for j in range(d):
                    acc = f32(acc + f32(f32(xg[g, m, j] - mu[j]) * R[j, k]))
                c.append(acc)
            coefs[g, m, :r] = c
            if quantize and r:
                z = f32(np.float16(min(c)))
                s = f32(np.float16(f32(f32(max(c) - z) / qmax)))
                q = [min(max(f32(f32(f32(f32(ck - z) / s) + f32(12582912.0)) - f32(12582912.0)), f32(0)), qmax)
                     if s > 0 else f32(0) for ck in c]
                c = [f32(f32(qk * s) + z) for qk in q]
            else:
                c = [reference.bf16_bits_to_f32(reference.f32_to_bf16_bits(np.array([ck], np.float32)))[0] for ck in c]
            for j in range(d):
                acc = f32(0)
                for k in range(r):
                    acc = f32(acc + f32(c[k] * R[j, k]))
                out[g, m, j] = f32(acc + mu[j])
    return coefs, out


@pytest.mark.parametrize("quantize", [None, "k8v4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_is_the_defined_arithmetic_exactly(chunks, quantize, dtype):
    x = chunks[0][:1, :, :2, :48, :].to(dtype)  # 1 layer, K and V, 2 heads, 48 tokens
    b = lowrank.calibrate(x, axes=AXES, energy=0.9, quantize=quantize)
    assert (b.ranks % 2 == 1).any() or quantize is None  # odd ranks exercise the nibble padding
    blocks = x[:, :, :, :6].reshape(1, 2, 2, 2, 3, 64).permute(3, 0, 1, 2, 4, 5).contiguous()  # 2 blocks of 3
    bound = bound_for(b, blocks)
    frame = lowrank.encode(blocks, bound)
    y = lowrank.decode(frame, bound)
    xg = blocks.permute(1, 2, 3, 0, 4, 5).reshape(b.groups, 6, 64).float().numpy()
    want_coefs, want = _scalar_reference(xg, b, quantize is not None)
    mask = reference.rank_mask(b, want_coefs.shape[2])[:, None, :]
    got_coefs = np.where(mask, reference.project(xg, b), np.float32(0))
    assert np.array_equal(got_coefs.view(np.uint32), want_coefs.view(np.uint32))  # float32, bit for bit
    header = lowrank.read_header(frame)
    body = frame[lowrank.HEADER_SIZE:].numpy()
    stored = reference.coefficients(body[:header.lengths[0]], body[header.lengths[0]:], b, 6)
    assert np.array_equal(reference.reconstruct(stored, b).view(np.uint32), want.view(np.uint32))
    got = y.permute(1, 2, 3, 0, 4, 5).reshape(b.groups, 6, 64)
    want_t = torch.from_numpy(reference.to_dtype_bits(want, str(dtype).removeprefix("torch.")).view(np.int16))
    assert torch.equal(got.contiguous().view(torch.int16), want_t.view(b.groups, 6, 64))


def test_full_rank_error_is_bf16_rounding(chunks):
    b = lowrank.calibrate(chunks[0], axes=AXES, energy=1.0)
    assert (b.ranks == 64).all()
    x = as_blocks(chunks[1], 73)
    bound = bound_for(b, x)
    y = lowrank.decode(lowrank.encode(x, bound), bound)
    # two bf16 roundings (coefficients, output), each at most 2**-9 relative: per vector
    assert rel_error(y, x) < 2 ** -8
    assert ((y.float() - x.float()).norm(dim=-1) <= 2 ** -7 * x.float().norm(dim=-1)).all()
    assert (y == x).float().mean() > 0.5


def test_error_falls_as_energy_rises(chunks):
    x = as_blocks(chunks[1], 73)  # calibrated on chunk 0, applied to chunk 1
    errors, sizes = [], []
    for energy in (0.9, 0.95, 0.99, 0.999):
        bound = bound_for(lowrank.calibrate(chunks[0], axes=AXES, energy=energy), x)
        frame = lowrank.encode(x, bound)
        errors.append(rel_error(lowrank.decode(frame, bound), x))
        sizes.append(frame.numel())
    assert errors == sorted(errors, reverse=True) and len(set(errors)) == 4, errors
    assert sizes == sorted(sizes) and len(set(sizes)) == 4, sizes
    assert sizes[0] < 0.7 * x.numel() * 2 and errors[-1] < 0.05


def test_k8v4_shrinks_frames_at_a_bounded_error(chunks, book):
    x = as_blocks(chunks[1], 73)
    q = lowrank.calibrate(chunks[0], axes=AXES, energy=0.99, quantize="k8v4")
    plain = lowrank.encode(x, bound_for(book, x))
    frame = lowrank.encode(x, bound_for(q, x))
    assert frame.numel() < 0.45 * plain.numel()
    assert rel_error(lowrank.decode(frame, bound_for(q, x)), x) < 1.3 * rel_error(lowrank.decode(plain, bound_for(book, x)), x)


# --- frames, blocks, capacity ---------------------------------------------------------------

def test_blocks_round_trip_into_a_cache(chunks, book):
    x = as_blocks(chunks[1], 73)
    bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
    c = codec.get("lowrank")
    frame = c.encode_blocks(x, torch.tensor([3, 0]), bound)
    assert codec.codec_of(frame) is c
    assert frame.numel() <= c.capacity((2, *x.shape[1:]), x.dtype)
    cache = torch.zeros(6, *x.shape[1:], dtype=x.dtype)
    c.decode_blocks(frame, cache, torch.tensor([5, 1]), bound)
    whole = c.decode(c.encode(x, bound), bound)
    assert bits_equal(cache[5], whole[3]) and bits_equal(cache[1], whole[0])
    assert not cache[0].view(torch.int16).any()
    out = torch.empty(2 * x[0].numel(), dtype=x.dtype)
    c.decode(frame, bound, out=out)
    assert bits_equal(out.view(2, *x.shape[1:]), torch.stack([whole[3], whole[0]]))
    with pytest.raises(codec.OutputMismatch):
        c.decode(frame, bound, out=torch.empty(10, dtype=x.dtype))
    with pytest.raises(codec.OutputMismatch):
        c.decode_blocks(frame, cache, torch.tensor([1, 2, 3]), bound)


def test_capacity_is_the_exact_worst_case(chunks):
    x = as_blocks(chunks[1], 73)[:2]
    full = lowrank.calibrate(chunks[0], axes=AXES, energy=1.0)
    c = codec.get("lowrank")
    assert lowrank.encode(x, bound_for(full, x)).numel() == c.capacity(x.shape, x.dtype)
    quant = lowrank.calibrate(chunks[0], axes=AXES, energy=1.0, quantize="k8v4")
    assert lowrank.encode(x, bound_for(quant, x)).numel() < c.capacity(x.shape, x.dtype)


def test_registry_entry():
    c = codec.get("lowrank")
    assert (c.frame_id, c.lossless, c.capabilities.standalone, c.capabilities.decode_needs_codebook) == (5, False, False, True)
    assert c not in codec.lossless()
    assert c.supports(torch.bfloat16) and c.supports(torch.float16) and not c.supports(torch.float8_e4m3fn)
    with pytest.raises(codec.UnsupportedTensor):
        c.encode(torch.zeros(4, 64, dtype=torch.float32), None)


def test_pooled_codebook_codes_any_tensor_by_its_last_axis(real_kv):
    c = codec.get("lowrank")
    b = c.calibrate(real_kv["c0_k"][:4], token_axis=1, energy=0.99)
    assert b.pooled and b.dims == (1, 1, 1, 64) and c.bind(b, None) is b
    x = torch.stack(real_kv["c1_k"][:4])
    y = c.decode(c.encode(x, b), b)
    assert y.shape == x.shape and rel_error(y, x) < 0.2


# --- refusals -------------------------------------------------------------------------------

def test_bind_refuses_layouts_that_do_not_fit(book):
    c = codec.get("lowrank")
    good = (4, 2, 3, 16, 64)
    assert isinstance(c.bind(book, BlockLayout(good, AXES)), lowrank.LowRankBinding)
    refusals = [
        BlockLayout((4, 2, 3, 16, 64), ("layer", "kv", "head", "token", "dim")),  # no channel
        BlockLayout((4, 2, 16, 192), ("layer", "kv", "token", "channel")),  # no head
        BlockLayout((4, 3, 16, 64, 2), ("layer", "head", "token", "channel", "pair")),  # no kv
        BlockLayout((4, 2, 2, 16, 64), AXES),  # 2 heads, codebook has 3
        BlockLayout((4, 2, 3, 16, 128), AXES),  # head dim 128
        BlockLayout((30, 2, 3, 16, 64), AXES),  # 30 layers, codebook has 4
        BlockLayout((2, 3, 16, 64), ("kv", "head", "token", "channel")),  # no layer axis: one layer
    ]
    for layout in refusals:
        with pytest.raises(codec.CodebookMismatch):
            c.bind(book, layout)
    with pytest.raises(codec.CodebookMismatch, match="layout"):
        c.bind(book, None)
    with pytest.raises(codec.CodebookMismatch):
        c.bind(book, BlockLayout(good, AXES), reference=torch.zeros(1))
    with pytest.raises(codec.CodebookMismatch):
        c.bind(codec.calibrate([torch.zeros(64, dtype=torch.bfloat16)]), BlockLayout(good, AXES))
    with pytest.raises(codec.CodebookMismatch, match="bind"):
        c.encode(torch.zeros(1, *good, dtype=torch.bfloat16), book)  # per-head codebook, no layout
    bound = c.bind(book, BlockLayout(good, AXES))
    with pytest.raises(codec.CodebookMismatch):
        c.encode(torch.zeros(1, 4, 2, 3, 8, 64, dtype=torch.bfloat16), bound)  # not the bound block shape


def test_decode_refuses_a_frame_of_another_codebook(chunks, book):
    x = as_blocks(chunks[1], 73)
    other = lowrank.calibrate(chunks[0], axes=AXES, energy=0.95)
    frame = lowrank.encode(x, bound_for(book, x))
    cache = torch.zeros_like(x)
    with pytest.raises(codec.CodebookMismatch, match=book.digest().hex()):
        lowrank.decode_blocks(frame, cache, torch.arange(x.shape[0]), bound_for(other, x))
    assert not cache.view(torch.int16).any()
    with pytest.raises(codec.CodebookMismatch):
        lowrank.decode(frame, None)


# --- golden frames --------------------------------------------------------------------------

GOLDEN_CASES = ["lowrank_bfloat16", "lowrank_float16_k8v4"]


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_frames(case):
    meta = json.loads((GOLDEN / f"{case}.meta.json").read_text())
    dtype = getattr(torch, meta["dtype"])
    book = lowrank.LowRankCodebook.from_json((GOLDEN / f"{case}.codebook.json").read_text())
    x = torch.frombuffer(bytearray((GOLDEN / f"{case}.input.bin").read_bytes()), dtype=torch.int16) \
        .view(dtype).view(meta["shape"])
    bound = lowrank.bind(book, BlockLayout(tuple(meta["shape"][1:]), tuple(meta["axes"])))
    frame = lowrank.encode(x, bound)
    assert frame.numpy().tobytes() == (GOLDEN / f"{case}.frame.bin").read_bytes()
    y = lowrank.decode(frame, bound)
    assert y.contiguous().view(torch.int16).numpy().tobytes() == (GOLDEN / f"{case}.output.bin").read_bytes()


# --- corrupt frames -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quant_case(chunks):
    b = lowrank.calibrate(chunks[0][:1], axes=AXES, energy=0.9, quantize="k8v4")
    assert (b.ranks[3:] % 2 == 1).any()  # an odd-rank V head: a padded nibble per vector
    x = as_blocks(chunks[1][:1], 16)[:3]
    bound = bound_for(b, x)
    return x, bound, lowrank.encode(x, bound)


def _refuses(frame, bound, shape, dtype):
    cache = torch.zeros(shape, dtype=dtype)
    with pytest.raises(codec.CorruptFrame):
        lowrank.decode_blocks(frame, cache, torch.arange(shape[0]), bound)
    assert not cache.view(torch.int16).any()
    with pytest.raises(codec.CorruptFrame):
        lowrank.decode(frame, bound)


def test_every_header_byte_is_checked(quant_case):
    x, bound, frame = quant_case
    for i in range(lowrank.HEADER_SIZE):
        bad = frame.clone()
        bad[i] ^= 0x10
        with pytest.raises(codec.CorruptFrame):
            lowrank.decode(bad, bound)


def test_stream_damage_truncation_and_extension_are_refused(quant_case):
    x, bound, frame = quant_case
    n = frame.numel()
    for pos in (lowrank.HEADER_SIZE, lowrank.HEADER_SIZE + 5, n // 2, n - 1):
        bad = frame.clone()
        bad[pos] ^= 0x01
        _refuses(bad, bound, x.shape, x.dtype)
    _refuses(frame[:-1].clone(), bound, x.shape, x.dtype)
    _refuses(frame[:100].clone(), bound, x.shape, x.dtype)
    _refuses(torch.cat([frame, torch.zeros(4, dtype=torch.uint8)]), bound, x.shape, x.dtype)


def _reheader(frame: torch.Tensor, **changes) -> torch.Tensor:
    """The frame with header fields changed and both CRCs made valid again."""
    from kvferry.codec.checksum import crc32c

    fields = list(_BODY.unpack(frame[:_BODY.size].numpy().tobytes()))
    for index, value in changes.items():
        fields[int(index.removeprefix("f"))] = value
    body = frame[lowrank.HEADER_SIZE:].numpy().tobytes()
    fields[-1] = crc32c(body)
    head = _BODY.pack(*fields)
    head += crc32c(head).to_bytes(4, "little")
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8)


def test_well_checksummed_lies_are_refused(quant_case):
    x, bound, frame = quant_case
    assert torch.equal(_reheader(frame), frame)
    b = bound.codebook
    vectors, bits = 48, b.bits()  # 3 blocks of 16 tokens
    # the unused high nibble of an odd-rank 4-bit V code byte set, CRCs recomputed
    g = next(g for g in range(b.groups) if bits[g] == 4 and b.ranks[g] % 2)
    codes = lowrank.HEADER_SIZE + 4 * b.groups * vectors  # params: scale and zero per vector, every group
    start = codes + vectors * sum(reference.code_bytes(int(b.ranks[i]), int(bits[i])) for i in range(g))
    last = start + reference.code_bytes(int(b.ranks[g]), 4) - 1  # last byte of the group's first vector
    bad = frame.clone()
    bad[last] |= 0xF0
    _refuses(_reheader(bad), bound, x.shape, x.dtype)
    # fields: 3 dtype, 4 ndim, 5 flags, 6..9 axis positions, 11..14 dims, 16..23 shape, 24 vectors, 25..26 lengths
    for change in ({"f3": 3}, {"f5": 0}, {"f5": 2}, {"f6": 2}, {"f9": 1}, {"f13": 4}, {"f24": 47}, {"f25": 0},
                   {"f26": 10}, {"f4": 5}, {"f10": 1}):
        _refuses(_reheader(frame, **change), bound, x.shape, x.dtype)
