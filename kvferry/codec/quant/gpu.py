"""GPU path of the quant codecs: fused Triton kernels writing ``reference.py``'s bytes.

One program takes a tile of consecutive vectors of one kind (K or V): it loads them once, finds
min/max, rounds the zero down and the scale up to fp16 with bit tricks, quantizes with correctly
rounded division once per vector (``div_rn``: Triton's ``/`` is approximate) and a multiply per
element, rounds half-to-even by adding and subtracting 2**23 (exact for 0 <= t < 2**22), packs codes LSB-first and stores codes and
(scale, zero) pairs as contiguous runs. Decode is the reverse. Kernels are launched with
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA that would change a value.

Sources are read in place when they are contiguous with the channel axis last and the kv axis
before it (a KV cache's usual layout): the vectors of a kind then lie in slabs of ``I`` (the
product of the axes between kv and channel) consecutive vectors, ``OB`` slabs per block (the axes
between the block axis and kv; one slab per "block" for a whole tensor), slab ``o`` of kind ``k``
of a block starting at element ``(o * 2 + k) * I * C`` of it. Programs take ``BLOCK_V``
consecutive vectors of the frame wherever they fall: each row finds its block, slab and place in
the slab with two integer divisions, and block ids gather (or scatter) whole blocks on the fly, so
tiles stay full however small slabs are. Any other layout goes through one
``movedim(...).contiguous()`` first.

Block ids on the device are checked by the kernels themselves (an id outside the cache sets a
flag and is never dereferenced), and a frame is checked by one kernel (padding, scales, zeros,
ids in range and unique) whose flag the decode kernels read before writing anything: a call
synchronizes with the host once, at its end, to raise what the flag says.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import BlockOutOfRange, UnsupportedTensor
from .format import FP16_MAX, QuantHeader, Stream
from .reference import MIN_SCALE

# Elements per program and warps, read at each call (bench/quant_gpu_check.py --blocks sweeps them).
ENCODE_TILE, ENCODE_WARPS = 4096, 4
DECODE_TILE, DECODE_WARPS = 4096, 4
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


# Flag bits of check_frame (and of the encode kernel's id check).
BAD_PADDING, BAD_ID, REPEATED_ID, BAD_PARAMS = 1, 2, 4, 8
BAD_VALUE = 16  # encode: a NaN, infinite or out-of-range element
CHECK_BLOCK = 4096  # parameter words (and ids) per program of the check kernel


@triton.jit
def _vectors(ids_ptr, n, VB, I, nblocks, blk_stride, KIND: tl.constexpr, C: tl.constexpr, BLOCK_V: tl.constexpr,
             GATHER: tl.constexpr, WIDE: tl.constexpr):
    """This program's ``BLOCK_V`` consecutive vectors of kind ``KIND``: their frame indices, the
    element offsets of their first channel in the source (or destination), the in-frame mask and
    the mask of rows whose block id is valid (the same without gathering)."""
    pid = tl.program_id(0)
    if WIDE:
        v = pid.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    else:
        v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = v < n
    b = v // VB  # block (or slab of a whole tensor)
    r = v - b * VB
    o = r // I  # slab of the block
    i = r - o * I
    inner = ((o * 2 + KIND) * I + i).to(tl.int64) * C
    if GATHER:
        blk = tl.load(ids_ptr + b, mask=rmask, other=0).to(tl.int64)
        ok = rmask & (blk >= 0) & (blk < nblocks)
        start = tl.where(ok, blk, 0) * blk_stride + inner
    else:
        ok = rmask
        start = b.to(tl.int64) * blk_stride + inner
    return v.to(tl.int64), start, rmask, ok


@triton.jit
def _encode_kernel(src_ptr, ids_ptr, codes_ptr, params_ptr, bad_ptr, n, VB, I, nblocks, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr, WIDE: tl.constexpr):
    j, start, rmask, ok = _vectors(ids_ptr, n, VB, I, nblocks, blk_stride, KIND, C, BLOCK_V, GATHER, WIDE)
    cols = tl.arange(0, BLOCK_C)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    bcols = tl.arange(0, BLOCK_C // PER)
    if BLOCK_C == C:  # a mask constant along the row keeps loads and stores vectorized
        mask = ok[:, None]
        bmask = rmask[:, None]
    else:
        mask = ok[:, None] & (cols < C)[None, :]
        bmask = rmask[:, None] & (bcols < BYTES)[None, :]
    x = tl.load(src_ptr + start[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # An element that is NaN, infinite or beyond the fp16 range makes its row's hi infinite (and
    # is reported); masked elements load as 0, within range, when the whole row is masked.
    xr = tl.where(tl.abs(x) <= 65504.0, x, float("inf"))
    if BLOCK_C == C:
        lo = tl.min(x, 1)
        hi = tl.max(xr, 1)
    else:
        lo = tl.min(tl.where(mask, x, float("inf")), 1)
        hi = tl.max(tl.where(mask, xr, float("-inf")), 1)
    flag = tl.max((hi > 65504.0).to(tl.int32), 0) * 16
    if GATHER:
        flag = flag | tl.max((rmask & (ok == 0)).to(tl.int32), 0) * 2
    tl.atomic_or(bad_ptr, flag, mask=flag != 0)

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
def _decode_kernel(codes_ptr, params_ptr, dst_ptr, ids_ptr, flag_ptr, n, VB, I, nblocks, blk_stride,
                   KIND: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                   BITS: tl.constexpr, GATHER: tl.constexpr, WIDE: tl.constexpr, GATE: tl.constexpr):
    j, start, rmask, ok = _vectors(ids_ptr, n, VB, I, nblocks, blk_stride, KIND, C, BLOCK_V, GATHER, WIDE)
    if GATE:  # check_frame's flag: a bad frame writes nothing
        ok = ok & (tl.zeros(ok.shape, tl.int32) + tl.load(flag_ptr) == 0)
    cols = tl.arange(0, BLOCK_C)
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = C * BITS // 8
    bcols = tl.arange(0, BLOCK_C // PER)
    if BLOCK_C == C:
        mask = ok[:, None]
        bmask = ok[:, None]
    else:
        mask = ok[:, None] & (cols < C)[None, :]
        bmask = ok[:, None] & (bcols < BYTES)[None, :]
    p = tl.load(params_ptr + j, mask=ok, other=0)
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
    tl.store(dst_ptr + start[:, None] + cols[None, :], out, mask=mask)


@triton.jit
def _check_kernel(frame_ptr, params_ptr, words, pad0, pad0_len, pad1, pad1_len, ids_ptr, nids, nblocks, marks_ptr,
                  flag_ptr, BLOCK: tl.constexpr, IDS: tl.constexpr):
    """Padding zero, every scale a positive finite fp16 and every zero a finite one, and (IDS)
    block ids in the cache and unique: flag bits BAD_PADDING, BAD_PARAMS, BAD_ID, REPEATED_ID."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < words
    p = tl.load(params_ptr + offs, mask=m, other=0x3C00)  # (scale 1.0, zero 0) where masked
    s = p & 0xFFFF
    z = (p >> 16) & 0xFFFF
    bad = ((s & 0x7C00) == 0x7C00) | ((s & 0x8000) != 0) | (s == 0) | ((z & 0x7C00) == 0x7C00)
    flag = tl.max(bad.to(tl.int32), 0) * 8
    k = tl.arange(0, 16)
    first = (pid == 0).to(tl.int32)  # program 0 reads the padding (at most 15 bytes a gap)
    a = tl.load(frame_ptr + pad0 + k, mask=k < pad0_len * first, other=0)
    b = tl.load(frame_ptr + pad1 + k, mask=k < pad1_len * first, other=0)
    flag = flag | tl.max(((a != 0) | (b != 0)).to(tl.int32), 0)
    if IDS:
        im = offs < nids
        blk = tl.load(ids_ptr + offs, mask=im, other=0).to(tl.int64)
        inside = im & (blk >= 0) & (blk < nblocks)
        flag = flag | tl.max((im & (inside == 0)).to(tl.int32), 0) * 2
        old = tl.atomic_add(marks_ptr + tl.where(inside, blk, 0), 1, mask=inside)
        flag = flag | tl.max((inside & (old != 0)).to(tl.int32), 0) * 4
    tl.atomic_or(flag_ptr, flag, mask=flag != 0)


def _in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether the kernels can address ``t`` directly (see the module docstring)."""
    return (t.is_contiguous() and channel_axis == t.dim() - 1 and kv_axis < channel_axis
            and (not blocks or kv_axis >= 1))


class _Geometry:
    """Where the vectors of each kind live: ``VB`` per block (``OB`` slabs of ``I``), ``n`` in
    all, and the launch that covers them with tiles of ``block_v`` vectors."""

    def __init__(self, t: torch.Tensor, kv_axis: int, channel_axis: int, ids: torch.Tensor | None, tile: int):
        shape = t.shape
        self.C = shape[channel_axis]
        self.I = math.prod(shape[kv_axis + 1:channel_axis])
        if ids is not None:
            self.VB = math.prod(shape[1:kv_axis]) * self.I
            self.n = ids.numel() * self.VB
            blk_stride, nblocks = t.stride(0), shape[0]
        else:
            self.VB = self.I
            self.n = math.prod(shape[:kv_axis]) * self.I
            blk_stride, nblocks = 2 * self.I * self.C, 0
        self.block_c = triton.next_power_of_2(self.C)
        self.block_v = max(1, tile // self.block_c)
        self.grid = (triton.cdiv(self.n, self.block_v),)
        if self.grid[0] >= 1 << 31:
            raise UnsupportedTensor(f"{self.n} vectors: too many programs for one launch")
        # int32 vector indices unless a block (or the frame) holds too many for them
        self.wide = self.n + self.block_v >= 1 << 31 or 2 * self.VB >= 1 << 31
        self.args = (ids if ids is not None else t, self.n, self.VB, max(self.I, 1), nblocks, blk_stride)


def _check(t: torch.Tensor, frame: torch.Tensor) -> None:
    if t.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedTensor(f"quant kernels take bfloat16 or float16, got {t.dtype}")
    if frame.dtype != torch.uint8 or frame.dim() != 1 or not frame.is_contiguous() or frame.device != t.device:
        raise UnsupportedTensor("the frame must be a contiguous 1-D uint8 tensor on the data's device")


def encode_into(src: torch.Tensor, frame: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                *, check_ids: bool = True, tile: int | None = None, num_warps: int | None = None) -> None:
    """Write the code and parameter streams of ``src`` (or of ``src[ids]``, blocks along dim 0)
    into ``frame`` (sized ``header.total``; header and padding are the caller's). Block ids are
    checked on the device unless ``check_ids`` is false (the caller checked them).

    Raises:
        UnsupportedTensor: a non-finite or out-of-range element (streams then hold garbage).
        BlockOutOfRange: a block id outside ``src`` (likewise).
    """
    _check(src, frame)
    tile, num_warps = tile or ENCODE_TILE, num_warps or ENCODE_WARPS
    kv, ch = header.kv_axis, header.channel_axis
    if not _in_place(src, kv, ch, ids is not None):
        if ids is not None:
            if check_ids and ids.numel() and not bool(((ids >= 0) & (ids < src.shape[0])).all()):
                raise BlockOutOfRange(f"block ids must be in 0..{src.shape[0] - 1}")
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
            GATHER=ids is not None, WIDE=geo.wide, num_warps=num_warps, enable_fp_fusion=False)
    flag = int(bad.item())
    if flag & BAD_ID:
        raise BlockOutOfRange(f"block ids must be in 0..{src.shape[0] - 1}")
    if flag:
        raise UnsupportedTensor(f"a NaN, infinite or out-of-range element (|x| > {FP16_MAX:g}): quant codecs "
                                "take finite values within the fp16 range, scales and zeros are fp16")


def check_frame(frame: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                nblocks: int = 0) -> torch.Tensor:
    """Launch the check of a frame whose header is valid: its padding, scales and zeros, and
    (given ``ids``) that the block ids lie in ``0..nblocks-1`` and do not repeat. Returns the
    device flag (int32[1], bits ``BAD_*``/``REPEATED_ID``, 0 when good) without waiting for it;
    ``decode_into(..., flag=)`` writes nothing unless it is 0."""
    if frame.storage_offset() % 4:
        raise UnsupportedTensor("the frame must start 4-byte aligned")
    nids = ids.numel() if ids is not None else 0
    scratch = torch.zeros(1 + (nblocks if nids else 0), dtype=torch.int32, device=frame.device)
    flag, marks = scratch[:1], scratch[1:] if nids else scratch
    offsets, lengths = header.offsets, header.lengths
    pads = [(o + n, nxt - o - n) for (o, n), nxt in zip(zip(offsets, lengths), offsets[1:])]
    words = 2 * header.vectors
    params = frame[offsets[Stream.PARAMS]:].view(torch.int32) if words else frame.view(torch.int32)
    grid = (max(1, triton.cdiv(max(words, nids), CHECK_BLOCK)),)
    _check_kernel[grid](frame, params, words, pads[0][0], pads[0][1], pads[1][0], pads[1][1],
                        ids if nids else frame, nids, nblocks, marks, flag, BLOCK=CHECK_BLOCK, IDS=nids > 0,
                        num_warps=4)
    return flag


def decode_into(frame: torch.Tensor, dst: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None,
                *, flag: torch.Tensor | None = None, tile: int | None = None, num_warps: int | None = None) -> None:
    """Reconstruct a checked frame into ``dst`` (the frame's shape), or into ``dst[ids]`` (the
    frame's axes are then the cache's; ids checked). ``dst`` must pass ``supports_in_place``.
    With ``flag`` (``check_frame``'s), nothing is written unless it is 0 when the kernels run."""
    _check(dst, frame)
    tile, num_warps = tile or DECODE_TILE, num_warps or DECODE_WARPS
    geo = _Geometry(dst, header.kv_axis, header.channel_axis, ids, tile)
    if geo.n == 0:
        return
    params = frame[header.offsets[Stream.PARAMS]:header.total].view(torch.int32)
    for kind in (0, 1):
        _decode_kernel[geo.grid](
            frame[header.offsets[kind]:], params[kind * geo.n:], dst, geo.args[0],
            flag if flag is not None else params, *geo.args[1:],
            KIND=kind, C=geo.C, BLOCK_C=geo.block_c, BLOCK_V=geo.block_v, BITS=header.bits[kind],
            GATHER=ids is not None, WIDE=geo.wide, GATE=flag is not None, num_warps=num_warps,
            enable_fp_fusion=False)


def supports_in_place(t: torch.Tensor, kv_axis: int, channel_axis: int, blocks: bool) -> bool:
    """Whether ``decode_into`` can write ``t`` directly (axes are ``t``'s own)."""
    return _in_place(t, kv_axis, channel_axis, blocks)

