"""The arithmetic that defines lowrank's bytes and reconstructions (numpy, CPU).

Every value is float32 and every operation rounds once, to nearest even; there is no fused
multiply-add. With vectors grouped per (layer, K/V, head) as ``x[g, m, :]``:

    encode   c[k] = 0;  for j = 0 .. d-1:  c[k] = c[k] + (x[j] - mean[j]) * R[j, k]      (k < r)
    decode   y[j] = 0;  for k = 0 .. r-1:  y[j] = y[j] + c'[k] * R[j, k];  y[j] = y[j] + mean[j]

where each ``+``, ``-`` and ``*`` is one float32 operation in that order, then ``y`` is rounded
to the tensor's dtype (nearest even; NaN becomes the canonical quiet NaN). ``c'`` is what the
frame holds: ``c`` rounded to bf16 (nearest even), or, quantized (``k8v4``), per vector:

    lo, hi = min c, max c;  z = f16(lo);  s = f16((hi - z) / qmax)          qmax = 255 (K), 15 (V)
    q = clamp(rint((c - z) / s), 0, qmax)     (q = 0 where s is not a finite positive number)
    c' = q * s + z

with ``/`` correctly rounded and ``rint`` round-half-even (``(t + 1.5 * 2**23) - 1.5 * 2**23``).
The numpy loops below run over the channel (or rank) index and are vectorised across vectors,
so they perform exactly these operations; the Triton kernels in ``gpu.py`` perform the same.
Results are defined for finite inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codebook import LowRankCodebook

MAGIC_RINT = np.float32(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds to an integer
CANONICAL_NAN = {"bfloat16": 0x7FC0, "float16": 0x7E00}


@dataclass(frozen=True)
class Plan:
    """How a tensor's dimensions map to (group, vector, channel): ``x.permute(perm)`` reshaped to
    ``(groups, vectors, d)`` lists each group's vectors in row-major order of the other dims."""

    shape: tuple[int, ...]
    positions: tuple[int | None, int | None, int | None, int]  # layer, kv, head, channel
    perm: tuple[int, ...]
    groups: int
    vectors: int
    channels: int

    @property
    def permuted_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[i] for i in self.perm)


def plan(shape: tuple[int, ...], positions: tuple[int | None, int | None, int | None, int]) -> Plan:
    """The plan for a tensor of ``shape`` whose layer/kv/head/channel dims are at ``positions``."""
    group = [p for p in positions[:3] if p is not None]
    channel = positions[3]
    rest = [i for i in range(len(shape)) if i not in group and i != channel]
    groups = int(np.prod([shape[p] for p in group], dtype=np.int64)) if group else 1
    vectors = int(np.prod([shape[i] for i in rest], dtype=np.int64)) if rest else 1
    return Plan(tuple(shape), positions, tuple(group + rest + [channel]), groups, vectors, shape[channel])


def f32_to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even), as uint16 bit patterns; NaN -> 0x7FC0."""
    b = f.astype(np.float32).view(np.uint32)
    r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(f), np.uint32(0x7FC0), r).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_dtype_bits(y: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the tensor dtype's uint16 bit patterns (nearest even, canonical NaN)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(y)
    with np.errstate(over="ignore"):
        h = y.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(y), np.uint16(CANONICAL_NAN["float16"]), h)


def project(xg: np.ndarray, book: LowRankCodebook) -> np.ndarray:
    """Coefficients ``(groups, vectors, rmax)`` float32 of ``xg`` ``(groups, vectors, d)``
    float32; columns at or past a group's rank are not used."""
    rmax = int(book.ranks.max(initial=0))
    g, m, d = xg.shape
    acc = np.zeros((g, m, rmax), dtype=np.float32)
    if rmax == 0:
        return acc
    xc = xg - book.means[:, None, :]
    rot = book.rotations[:, :, :rmax]
    for j in range(d):
        acc += xc[:, :, j:j + 1] * rot[:, None, j, :]
    return acc


def reconstruct(coef: np.ndarray, book: LowRankCodebook) -> np.ndarray:
    """float32 vectors ``(groups, vectors, d)`` from coefficients ``(groups, vectors, rmax)``
    whose columns past each group's rank are zero (adding ``0 * R`` leaves the sum unchanged)."""
    g, m, rmax = coef.shape
    d = book.channels
    acc = np.zeros((g, m, d), dtype=np.float32)
    for k in range(rmax):
        acc += coef[:, :, k:k + 1] * book.rotations[:, None, :, k]
    return acc + book.means[:, None, :]


def rank_mask(book: LowRankCodebook, rmax: int) -> np.ndarray:
    return np.arange(rmax)[None, :] < book.ranks[:, None]


def quantize(coef: np.ndarray, ranks: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per vector: codes ``(groups, vectors, rmax)`` uint8 (0 past the rank), fp16 scales and
    zeros ``(groups, vectors)`` (0 for rank-0 groups)."""
    g, m, rmax = coef.shape
    valid = (np.arange(rmax)[None, :] < ranks[:, None])[:, None, :]
    qmax = ((1 << bits.astype(np.int64)) - 1).astype(np.float32)[:, None]
    with np.errstate(all="ignore"):
        lo = np.where(valid, coef, np.float32(np.inf)).min(axis=2, initial=np.float32(np.inf))
        hi = np.where(valid, coef, np.float32(-np.inf)).max(axis=2, initial=np.float32(-np.inf))
        has = (ranks > 0)[:, None]
        lo = np.where(has, lo, np.float32(0))
        hi = np.where(has, hi, np.float32(0))
        z16 = lo.astype(np.float16)
        z = z16.astype(np.float32)
        s16 = ((hi - z) / qmax).astype(np.float16)
        s = s16.astype(np.float32)
        ok = np.isfinite(s) & (s > 0)
        t = (coef - z[:, :, None]) / np.where(ok, s, np.float32(1))[:, :, None]
        q = (t + MAGIC_RINT) - MAGIC_RINT
        q = np.clip(q, np.float32(0), qmax[:, :, None])
    q = np.where(ok[:, :, None] & valid, q, np.float32(0)).astype(np.uint8)
    return q, s16, z16


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Coefficients ``q * s + z`` float32 ``(groups, vectors, rmax)``, 0 past each rank."""
    rmax = codes.shape[2]
    valid = (np.arange(rmax)[None, :] < ranks[:, None])[:, None, :]
    with np.errstate(all="ignore"):
        c = codes.astype(np.float32) * scales.astype(np.float32)[:, :, None] + zeros.astype(np.float32)[:, :, None]
    return np.where(valid, c, np.float32(0))


def code_bytes(rank: int, bits: int) -> int:
    """Bytes of one vector's codes: whole bytes per vector (4-bit codes two to a byte, low first)."""
    return (rank * bits + 7) // 8


def pack_codes(codes: np.ndarray, ranks: np.ndarray, bits: np.ndarray) -> bytes:
    """The code stream: per group in order, per vector, ``code_bytes(rank, bits)`` bytes."""
    parts = []
    for g in range(codes.shape[0]):
        r = int(ranks[g])
        if r == 0:
            continue
        q = codes[g, :, :r]
        if bits[g] == 8:
            parts.append(np.ascontiguousarray(q).tobytes())
        else:
            if r % 2:
                q = np.concatenate([q, np.zeros((q.shape[0], 1), dtype=np.uint8)], axis=1)
            parts.append((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).tobytes())
    return b"".join(parts)


def unpack_codes(stream: np.ndarray, ranks: np.ndarray, bits: np.ndarray, vectors: int) -> np.ndarray:
    """Inverse of ``pack_codes``: ``(groups, vectors, rmax)`` uint8. The caller checked the length
    and the unused high nibbles."""
    rmax = int(ranks.max(initial=0))
    out = np.zeros((ranks.size, vectors, rmax), dtype=np.uint8)
    pos = 0
    for g in range(ranks.size):
        r = int(ranks[g])
        if r == 0:
            continue
        nb = code_bytes(r, int(bits[g]))
        block = stream[pos:pos + nb * vectors].reshape(vectors, nb)
        pos += nb * vectors
        if bits[g] == 8:
            out[g, :, :r] = block
        else:
            both = np.stack([block & 0x0F, block >> 4], axis=2).reshape(vectors, 2 * nb)
            out[g, :, :r] = both[:, :r]
    return out


def encode_streams(xg: np.ndarray, book: LowRankCodebook) -> tuple[bytes, bytes]:
    """(params, coefficients) streams of ``xg`` ``(groups, vectors, d)`` float32."""
    coef = project(xg, book)
    ranks = book.ranks
    if book.quantize is None:
        bits = f32_to_bf16_bits(coef)
        parts = [np.ascontiguousarray(bits[g, :, :int(r)]).astype("<u2").tobytes() for g, r in enumerate(ranks)]
        return b"", b"".join(parts)
    bits = book.bits()
    codes, scales, zeros = quantize(coef, ranks, bits)
    params = np.stack([scales, zeros], axis=2).astype("<f2")
    return params.tobytes(), pack_codes(codes, ranks, bits)


def stream_lengths(book: LowRankCodebook, vectors: int) -> tuple[int, int]:
    """Bytes of the (params, coefficients) streams for ``vectors`` vectors per group."""
    if book.quantize is None:
        return 0, 2 * vectors * int(book.ranks.sum())
    per = sum(code_bytes(int(r), int(b)) for r, b in zip(book.ranks, book.bits()))
    return 4 * vectors * book.groups, vectors * per


def coefficients(params: np.ndarray, coefs: np.ndarray, book: LowRankCodebook, vectors: int) -> np.ndarray:
    """The coefficients ``c'`` a frame's streams hold, ``(groups, vectors, rmax)`` float32."""
    ranks = book.ranks
    rmax = int(ranks.max(initial=0))
    if book.quantize is None:
        out = np.zeros((ranks.size, vectors, rmax), dtype=np.float32)
        words = coefs.view("<u2")
        pos = 0
        for g, r in enumerate(ranks):
            r = int(r)
            out[g, :, :r] = bf16_bits_to_f32(words[pos:pos + vectors * r].reshape(vectors, r))
            pos += vectors * r
        return out
    sz = params.view("<f2").reshape(ranks.size, vectors, 2)
    codes = unpack_codes(coefs, ranks, book.bits(), vectors)
    return dequantize(codes, sz[:, :, 0], sz[:, :, 1], ranks)
