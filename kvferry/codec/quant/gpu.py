"""GPU path of the quant codecs: fused Triton kernels writing ``reference.py``'s bytes.

One program takes a tile of consecutive vectors of one kind (K or V): it loads them once, finds
min/max, rounds the zero down and the scale up to fp16 with bit tricks, quantizes with correctly
rounded division once per vector (``div_rn``: Triton's ``/`` is approximate) and a multiply per
element, rounds half-to-even by adding and subtracting 2**23 (exact for 0 <= t < 2**22), packs codes LSB-first and stores codes and
(scale, zero) pairs as contiguous runs. Decode is the reverse. Kernels are launched with
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA that would change a value.

Sources are read in place when they are contiguous with the channel axis last and the kv axis
before it (a KV cache's usual layout): vector ``j`` of kind ``k`` is then element
``((o * 2 + k) * I + i) * C`` with ``o, i = divmod(j, I)``, and block ids gather (or scatter) whole
blocks on the fly. Any other layout goes through one ``movedim(...).contiguous()`` first.
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
def _vector_base(rows, ids_ptr, mask, I, OB, blk_stride, KIND: tl.constexpr, C: tl.constexpr,
                 GATHER: tl.constexpr):
    o = rows // I
    i = rows % I
    if GATHER:
        blk = tl.load(ids_ptr + o // OB, mask=mask, other=0).to(tl.int64)
        base = blk * blk_stride + (((o % OB) * 2 + KIND) * I + i) * C
    else:
        base = ((o * 2 + KIND) * I + i) * C
    return base


@triton.jit
def _encode_kernel(src_ptr, ids_ptr, codes_ptr, params_ptr, bad_ptr, n, I, OB, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < n
    cols = tl.arange(0, BLOCK_C)
    mask = rmask[:, None] & (cols < C)[None, :]
    base = _vector_base(rows, ids_ptr, rmask, I, OB, blk_stride, KIND, C, GATHER)
    x = tl.load(src_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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

    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    if PER == 1:
        packed = q
        bcols = cols
    else:
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(tl.reshape(q, (BLOCK_V, BLOCK_C // PER, PER)) << shifts[None, None, :], axis=2)
        bcols = tl.arange(0, BLOCK_C // PER)
    bmask = rmask[:, None] & (bcols < BYTES)[None, :]
    tl.store(codes_ptr + rows[:, None] * BYTES + bcols[None, :], packed.to(tl.uint8), mask=bmask)
    tl.store(params_ptr + rows, sb | (zb << 16), mask=rmask)


@triton.jit
def _decode_kernel(codes_ptr, params_ptr, dst_ptr, ids_ptr, n, I, OB, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < n
    cols = tl.arange(0, BLOCK_C)
    mask = rmask[:, None] & (cols < C)[None, :]
    p = tl.load(params_ptr + rows, mask=rmask, other=0)
    s = _bits_to_f32(p & 0xFFFF)
    z = _bits_to_f32((p >> 16) & 0xFFFF)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    byte = tl.load(codes_ptr + rows[:, None] * BYTES + (cols // PER)[None, :], mask=mask, other=0).to(tl.int32)
    q = (byte >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    y = q.to(tl.float32) * s[:, None] + z[:, None]
    y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
    base = _vector_base(rows, ids_ptr, rmask, I, OB, blk_stride, KIND, C, GATHER)
    if dst_ptr.dtype.element_ty == tl.bfloat16:
        # Round to nearest even by hand: the interpreter's cast truncates (the GPU's does not).
        b = y.to(tl.int32, bitcast=True)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + base[:, None] + cols[None, :], out, mask=mask)


def _in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether the kernels can address ``t`` directly (see the module docstring)."""
    return (t.is_contiguous() and channel_axis == t.dim() - 1 and kv_axis < channel_axis
            and (not blocks or kv_axis >= 1))


class _Geometry:
    """Where vector ``j`` of each kind lives in a source (or destination) tensor."""

    def __init__(self, t: torch.Tensor, kv_axis: int, channel_axis: int, ids: torch.Tensor | None):
        shape = t.shape
        self.C = shape[channel_axis]
        self.I = math.prod(shape[kv_axis + 1:channel_axis])
        start = 1 if ids is not None else 0
        self.OB = math.prod(shape[start:kv_axis])
        self.blk_stride = t.stride(0) if ids is not None else 0
        self.ids = ids
        blocks = ids.numel() if ids is not None else 1
        self.n = blocks * self.OB * self.I

    def launch_args(self, t: torch.Tensor) -> tuple:
        ids = self.ids if self.ids is not None else t  # never read without GATHER
        return ids, self.n, max(self.I, 1), max(self.OB, 1), self.blk_stride


def _tiles(c: int, tile: int) -> tuple[int, int]:
    block_c = triton.next_power_of_2(c)
    return block_c, max(1, tile // block_c)


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
    geo = _Geometry(src, kv, ch, ids)
    if geo.n == 0:
        return
    bad = torch.zeros(1, dtype=torch.int32, device=src.device)
    params = frame[header.offsets[Stream.PARAMS]:header.total].view(torch.int32)
    block_c, block_v = _tiles(geo.C, tile)
    ids_arg, *rest = geo.launch_args(src)
    for kind in (0, 1):
        _encode_kernel[(triton.cdiv(geo.n, block_v),)](
            src, ids_arg, frame[header.offsets[kind]:], params[kind * geo.n:], bad, *rest,
            KIND=kind, C=geo.C, BLOCK_C=block_c, BLOCK_V=block_v, BITS=header.bits[kind], GATHER=ids is not None,
            num_warps=num_warps, enable_fp_fusion=False)
    if bad.item():
        raise UnsupportedTensor(f"a NaN, infinite or out-of-range element (|x| > {FP16_MAX:g}): quant codecs "
                                "take finite values within the fp16 range, scales and zeros are fp16")


def decode_into(frame: torch.Tensor, dst: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                *, tile: int = TILE, num_warps: int = NUM_WARPS) -> None:
    """Reconstruct a checked frame into ``dst`` (the frame's shape), or into ``dst[ids]`` (the
    frame's axes are then the cache's). ``dst`` must pass ``supports_in_place``."""
    _check(dst, frame)
    geo = _Geometry(dst, header.kv_axis, header.channel_axis, ids)
    if geo.n == 0:
        return
    params = frame[header.offsets[Stream.PARAMS]:header.total].view(torch.int32)
    block_c, block_v = _tiles(geo.C, tile)
    ids_arg, *rest = geo.launch_args(dst)
    for kind in (0, 1):
        _decode_kernel[(triton.cdiv(geo.n, block_v),)](
            frame[header.offsets[kind]:], params[kind * geo.n:], dst, ids_arg, *rest,
            KIND=kind, C=geo.C, BLOCK_C=block_c, BLOCK_V=block_v, BITS=header.bits[kind], GATHER=ids is not None,
            num_warps=num_warps, enable_fp_fusion=False)


def supports_in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether ``decode_into`` can write ``t`` directly (axes are ``t``'s own)."""
    return _in_place(t, kv_axis, channel_axis, blocks)

