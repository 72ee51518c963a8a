"""GPU path of the quant codecs: fused Triton kernels writing ``reference.py``'s bytes.

One program takes a tile of consecutive vectors of one kind (K or V): it loads them once, finds
min/max, rounds the zero down and the scale up to fp16 with bit tricks, quantizes with correctly
rounded division once per vector (``div_rn``: Triton's ``/`` is approximate) and a multiply per
element, rounds half-to-even by adding and subtracting 2**23 (exact for 0 <= t < 2**22), packs codes LSB-first and stores codes and
(scale, zero) pairs as contiguous runs. Decode is the reverse. Kernels are launched with
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA that would change a value.

Sources are read in place when they are contiguous with the channel axis last and the kv axis
before it (a KV cache's usual layout): the vectors of a kind then lie in slabs of ``I`` (the
product of the axes between kv and channel) consecutive vectors, slab ``o`` of kind ``k`` starting
at element ``(o * 2 + k) * I * C``. A program takes a tile of one slab (so there is no division
per vector), and block ids gather (or scatter) whole blocks on the fly. Any other layout goes
through one ``movedim(...).contiguous()`` first.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import UnsupportedTensor
from .format import FP16_MAX, QuantHeader, Stream
from .reference import MIN_SCALE

TILE = 4096  # elements per program
NUM_WARPS = 4
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _round_down_fp16(v):
    b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    r = b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    step = tl.where(b == 0, 0x8001, tl.where(b >= 0x8000, b + 1, b - 1))
    return tl.where(r > v, step, b)


@triton.jit
def _round_up_fp16(v):
    b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    r = b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(r < v, b + 1, b)


@triton.jit
def _bits_to_f32(b):
    return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _slab(ptr, ids_ptr, o, I, OB, blk_stride, KIND: tl.constexpr, C: tl.constexpr, GATHER: tl.constexpr):
    """Pointer to the first of slab ``o``'s ``I`` consecutive vectors of kind ``KIND``."""
    if GATHER:
        blk = tl.load(ids_ptr + o // OB).to(tl.int64)
        start = blk * blk_stride + ((o % OB) * 2 + KIND).to(tl.int64) * I * C
    else:
        start = (o.to(tl.int64) * 2 + KIND) * I * C
    return ptr + start


@triton.jit
def _tile(I, tiles, BLOCK_V: tl.constexpr):
    """This program's slab, its vectors' indices in the slab and in the frame, and their mask.
    One scalar division per program: no per-vector division."""
    pid = tl.program_id(0)
    o = pid // tiles
    i = (pid % tiles) * BLOCK_V + tl.arange(0, BLOCK_V)
    return o, i.to(tl.int64), o.to(tl.int64) * I + i, i < I


@triton.jit
def _encode_kernel(src_ptr, ids_ptr, codes_ptr, params_ptr, bad_ptr, I, tiles, OB, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr):
    o, i, j, rmask = _tile(I, tiles, BLOCK_V)
    cols = tl.arange(0, BLOCK_C)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    bcols = tl.arange(0, BLOCK_C // PER)
    if BLOCK_C == C:  # a mask constant along the row keeps loads and stores vectorized
        mask = rmask[:, None]
        bmask = rmask[:, None]
    else:
        mask = rmask[:, None] & (cols < C)[None, :]
        bmask = rmask[:, None] & (bcols < BYTES)[None, :]
    src = _slab(src_ptr, ids_ptr, o, I, OB, blk_stride, KIND, C, GATHER)
    x = tl.load(src + i[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bad = ((tl.abs(x) > 65504.0) | (x != x)) & mask
    flag = tl.max(tl.max(bad.to(tl.int32), 1), 0)
    tl.atomic_max(bad_ptr, flag, mask=flag != 0)

    lo = tl.min(tl.where(mask, x, float("inf")), 1)
    hi = tl.max(tl.where(mask, x, float("-inf")), 1)
    lo = tl.where(lo == 0.0, 0.0, lo)
    zb = _round_down_fp16(lo)
    z = _bits_to_f32(zb)
    levels: tl.constexpr = (1 << BITS) - 1
    d = tl.maximum(tl.math.div_rn(hi - z, tl.full(hi.shape, levels, tl.float32)), _MIN_SCALE)
    sb = _round_up_fp16(d)
    s = _bits_to_f32(sb)
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    t = (x - z[:, None]) * r[:, None]
    q = (t + 8388608.0) - 8388608.0
    q = tl.minimum(tl.maximum(q, 0.0), levels * 1.0).to(tl.int32)

    if BITS == 8:
        packed = q
    elif BITS == 4:
        a, b = tl.split(tl.reshape(q, (BLOCK_V, BLOCK_C // 2, 2)))
        packed = a | (b << 4)
    else:  # codes 4k + 2a + b: split b (even/odd), then a
        even, odd = tl.split(tl.reshape(q, (BLOCK_V, BLOCK_C // 4, 2, 2)))
        q0, q2 = tl.split(even)
        q1, q3 = tl.split(odd)
        packed = q0 | (q1 << 2) | (q2 << 4) | (q3 << 6)
    tl.store(codes_ptr + j[:, None] * BYTES + bcols[None, :], packed.to(tl.uint8), mask=bmask)
    tl.store(params_ptr + j, sb | (zb << 16), mask=rmask)


@triton.jit
def _decode_kernel(codes_ptr, params_ptr, dst_ptr, ids_ptr, I, tiles, OB, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr):
    o, i, j, rmask = _tile(I, tiles, BLOCK_V)
    cols = tl.arange(0, BLOCK_C)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    bcols = tl.arange(0, BLOCK_C // PER)
    if BLOCK_C == C:
        mask = rmask[:, None]
        bmask = rmask[:, None]
    else:
        mask = rmask[:, None] & (cols < C)[None, :]
        bmask = rmask[:, None] & (bcols < BYTES)[None, :]
    p = tl.load(params_ptr + j, mask=rmask, other=0)
    s = _bits_to_f32(p & 0xFFFF)
    z = _bits_to_f32((p >> 16) & 0xFFFF)
    byte = tl.load(codes_ptr + j[:, None] * BYTES + bcols[None, :], mask=bmask, other=0).to(tl.int32)
    if BITS == 8:
        q = byte
    elif BITS == 4:
        q = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_V, BLOCK_C))
    else:  # join adds the last axis: [k, a, b] holds code 4k + 2a + b
        q = tl.reshape(tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, byte >> 6)),
                       (BLOCK_V, BLOCK_C))
    y = q.to(tl.float32) * s[:, None] + z[:, None]
    y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
    if dst_ptr.dtype.element_ty == tl.bfloat16:
        # Round to nearest even by hand: the interpreter's cast truncates (the GPU's does not).
        b = y.to(tl.int32, bitcast=True)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(dst_ptr.dtype.element_ty)
    dst = _slab(dst_ptr, ids_ptr, o, I, OB, blk_stride, KIND, C, GATHER)
    tl.store(dst + i[:, None] * C + cols[None, :], out, mask=mask)


def _in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether the kernels can address ``t`` directly (see the module docstring)."""
    return (t.is_contiguous() and channel_axis == t.dim() - 1 and kv_axis < channel_axis
            and (not blocks or kv_axis >= 1))


class _Geometry:
    """Where the vectors of each kind live: ``slabs`` runs of ``I`` consecutive vectors (``OB``
    slabs per block when blocks are gathered), and the launch that covers them."""

    def __init__(self, t: torch.Tensor, kv_axis: int, channel_axis: int, ids: torch.Tensor | None, tile: int):
        shape = t.shape
        self.C = shape[channel_axis]
        self.I = math.prod(shape[kv_axis + 1:channel_axis])
        self.OB = math.prod(shape[1:kv_axis]) if ids is not None else 1
        self.slabs = ids.numel() * self.OB if ids is not None else math.prod(shape[:kv_axis])
        self.n = self.slabs * self.I
        self.block_c = triton.next_power_of_2(self.C)
        self.block_v = min(max(1, tile // self.block_c), triton.next_power_of_2(max(self.I, 1)))
        self.tiles = triton.cdiv(self.I, self.block_v)
        self.grid = (self.slabs * self.tiles,)
        if self.grid[0] >= 1 << 31:
            raise UnsupportedTensor(f"{self.n} vectors in slabs of {self.I}: too many programs for one launch")
        self.args = (ids if ids is not None else t, self.I, self.tiles, self.OB, t.stride(0) if ids is not None else 0)


def _check(t: torch.Tensor, frame: torch.Tensor) -> None:
    if t.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedTensor(f"quant kernels take bfloat16 or float16, got {t.dtype}")
    if frame.dtype != torch.uint8 or frame.dim() != 1 or not frame.is_contiguous() or frame.device != t.device:
        raise UnsupportedTensor("the frame must be a contiguous 1-D uint8 tensor on the data's device")


def encode_into(src: torch.Tensor, frame: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                *, tile: int = TILE, num_warps: int = NUM_WARPS) -> None:
    """Write the code and parameter streams of ``src`` (or of ``src[ids]``, blocks along dim 0)
    into ``frame`` (sized ``header.total``; header and padding are the caller's).

    Raises:
        UnsupportedTensor: a non-finite or out-of-range element (streams then hold garbage).
    """
    _check(src, frame)
    kv, ch = header.kv_axis, header.channel_axis
    if not _in_place(src, kv, ch, ids is not None):
        if ids is not None:
            src, ids = src.index_select(0, ids), None
        src, kv, ch = src.movedim((kv, ch), (0, -1)).contiguous(), 0, src.dim() - 1
    geo = _Geometry(src, kv, ch, ids, tile)
    if geo.n == 0:
        return
    bad = torch.zeros(1, dtype=torch.int32, device=src.device)
    params = frame[header.offsets[Stream.PARAMS]:header.total].view(torch.int32)
    for kind in (0, 1):
        _encode_kernel[geo.grid](
            src, geo.args[0], frame[header.offsets[kind]:], params[kind * geo.n:], bad, *geo.args[1:],
            KIND=kind, C=geo.C, BLOCK_C=geo.block_c, BLOCK_V=geo.block_v, BITS=header.bits[kind],
            GATHER=ids is not None, num_warps=num_warps, enable_fp_fusion=False)
    if bad.item():
        raise UnsupportedTensor(f"a NaN, infinite or out-of-range element (|x| > {FP16_MAX:g}): quant codecs "
                                "take finite values within the fp16 range, scales and zeros are fp16")


def decode_into(frame: torch.Tensor, dst: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                *, tile: int = TILE, num_warps: int = NUM_WARPS) -> None:
    """Reconstruct a checked frame into ``dst`` (the frame's shape), or into ``dst[ids]`` (the
    frame's axes are then the cache's). ``dst`` must pass ``supports_in_place``."""
    _check(dst, frame)
    geo = _Geometry(dst, header.kv_axis, header.channel_axis, ids, tile)
    if geo.n == 0:
        return
    params = frame[header.offsets[Stream.PARAMS]:header.total].view(torch.int32)
    for kind in (0, 1):
        _decode_kernel[geo.grid](
            frame[header.offsets[kind]:], params[kind * geo.n:], dst, *geo.args,
            KIND=kind, C=geo.C, BLOCK_C=geo.block_c, BLOCK_V=geo.block_v, BITS=header.bits[kind],
            GATHER=ids is not None, num_warps=num_warps, enable_fp_fusion=False)


def supports_in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether ``decode_into`` can write ``t`` directly (axes are ``t``'s own)."""
    return _in_place(t, kv_axis, channel_axis, blocks)

