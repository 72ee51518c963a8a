"""GPU path of tca-tbe: Triton kernels writing and reading the reference's bytes.

Encode is three passes over the tensor: an exponent histogram (per-program partial histograms,
summed and windowed on the device), per-tile in-window counts, and after an exclusive prefix
sum of the counts (``torch.cumsum``) a scatter pass that writes the bitmaps, both offset streams,
SIGNMAN and FALLBACK. The frame's size depends on the data, so encode reads two numbers back
(window and in-window count) once, between the second and third pass.

Decode is a check pass (offsets agree with the bitmaps' popcounts, no codes past the end,
zero padding) and, only if it found nothing wrong, the decode pass: each element finds its
value from its tile's start and a prefix count within the tile, constant time and branch-free.
Works on CPU tensors under ``TRITON_INTERPRET=1`` too (the tests run it that way).
"""

from __future__ import annotations

import functools

import torch

from ..dtypes import layout_for
from ..errors import CorruptFrame
from ..format import stored_size
from ..frames import encode_stored
from .format import GROUP_TILES, PLANES, TILE, WINDOW, Stream, TcaTbeHeader, make_header, padding_ranges

try:
    import triton
    import triton.language as tl
except ImportError:  # the codec then uses the reference by way of host copies
    triton = None

assert (TILE, PLANES, GROUP_TILES) == (64, 3, 1024)  # the kernels spell these out
TILES_PER_PROGRAM = 16     # 1024 elements a program (bench/tcatbe_gpu_check.py sweeps these two)
NUM_WARPS = 4
HIST_BLOCK = 4096
HIST_ITERS = 16            # 64 Ki elements a histogram program: few partial histograms to sum


@functools.cache
def available() -> bool:
    """True when triton is importable and CUDA is usable."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _histogram_kernel(x_ptr, hist_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * (BLOCK * ITERS)
        acc = tl.zeros([256], dtype=tl.int32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.int32)
            acc += tl.histogram((v >> 7) & 0xFF, 256)  # elements past n count as exponent 0
        tl.store(hist_ptr + pid * 256 + tl.arange(0, 256), acc)

    @triton.jit
    def _count_kernel(x_ptr, low_ptr, counts_ptr, n, tiles, TPB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * TPB + tl.arange(0, TPB)
        idx = t[:, None] * 64 + tl.arange(0, 64)[None, :]
        valid = idx < n
        v = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32)
        rel = ((v >> 7) & 0xFF) - tl.load(low_ptr).to(tl.int32)
        inside = (rel >= 0) & (rel < 7) & valid
        tl.store(counts_ptr + t, tl.sum(inside.to(tl.int32), axis=1), mask=t < tiles)

    @triton.jit
    def _encode_kernel(x_ptr, low_ptr, starts_ptr, bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr,
                       n, tiles, TPB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * TPB + tl.arange(0, TPB)
        tmask = t < tiles
        p = tl.arange(0, 64)
        idx = t[:, None] * 64 + p[None, :]
        valid = idx < n
        v = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32)
        rel = ((v >> 7) & 0xFF) - tl.load(low_ptr).to(tl.int32)
        inside = (rel >= 0) & (rel < 7) & valid
        code = tl.where(inside, rel + 1, 0)
        low_half = (p < 32)[None, :]
        shift = (p & 31)[None, :]
        for k in tl.static_range(3):  # plane k as two 32-bit words; bits are disjoint, so sums are ORs
            bit = ((code >> k) & 1) << shift
            tl.store(bitmaps_ptr + t * 6 + 2 * k, tl.sum(tl.where(low_half, bit, 0), axis=1), mask=tmask)
            tl.store(bitmaps_ptr + t * 6 + 2 * k + 1, tl.sum(tl.where(low_half, 0, bit), axis=1), mask=tmask)
        start = tl.load(starts_ptr + t, mask=tmask, other=0)
        group_start = tl.load(starts_ptr + (t // 1024) * 1024, mask=tmask, other=0)
        tl.store(tilerel_ptr + t, (start - group_start).to(tl.int16), mask=tmask)  # u16 bits
        tl.store(groups_ptr + t // 1024, start, mask=tmask & (t % 1024 == 0))
        ones = inside.to(tl.int32)
        rank = tl.cumsum(ones, axis=1) - ones  # in-window elements before this one in its tile
        h_idx = start[:, None] + rank
        f_idx = t[:, None] * 64 - start[:, None] + p[None, :] - rank
        sm = ((v >> 8) & 0x80) | (v & 0x7F)
        tl.store(sm_ptr + h_idx, sm.to(tl.uint8), mask=inside)
        tl.store(fb_ptr + f_idx, v.to(tl.int16), mask=valid & (code == 0))

    @triton.jit
    def _tile_start(groups_ptr, tilerel_ptr, t, mask):
        base = tl.load(groups_ptr + t // 1024, mask=mask, other=0)
        rel = tl.load(tilerel_ptr + t, mask=mask, other=0).to(tl.int64) & 0xFFFF
        return base, rel

    @triton.jit
    def _plane_bits(bitmaps_ptr, t, tmask, k, low_half, shift):
        """Bit p of plane k of each tile, as [TPB, 64] int32 (two 32-bit words: no 64-bit shifts)."""
        lo = tl.load(bitmaps_ptr + t * 6 + 2 * k, mask=tmask, other=0)
        hi = tl.load(bitmaps_ptr + t * 6 + 2 * k + 1, mask=tmask, other=0)
        return (tl.where(low_half, lo[:, None], hi[:, None]) >> shift) & 1

    @triton.jit
    def _codes(bitmaps_ptr, t, tmask):
        p = tl.arange(0, 64)
        low_half = (p < 32)[None, :]
        shift = (p & 31)[None, :]
        return (_plane_bits(bitmaps_ptr, t, tmask, 0, low_half, shift)
                | (_plane_bits(bitmaps_ptr, t, tmask, 1, low_half, shift) << 1)
                | (_plane_bits(bitmaps_ptr, t, tmask, 2, low_half, shift) << 2))

    @triton.jit
    def _check_kernel(bitmaps_ptr, groups_ptr, tilerel_ptr, bad_ptr, n, tiles, in_window, TPB: tl.constexpr):
        pid = tl.program_id(0)
        t = pid.to(tl.int64) * TPB + tl.arange(0, TPB)
        tmask = t < tiles
        coded = (_codes(bitmaps_ptr, t, tmask) != 0).to(tl.int32)
        count = tl.sum(coded, axis=1).to(tl.int64)
        # No codes for elements past the end of the tensor.
        past = (t[:, None] * 64 + tl.arange(0, 64)[None, :]) >= n
        bad = tl.sum(tl.where(past, coded, 0), axis=1) != 0
        base, rel = _tile_start(groups_ptr, tilerel_ptr, t, tmask)
        start = base + rel
        nmask = tmask & (t + 1 < tiles)
        nbase, nrel = _tile_start(groups_ptr, tilerel_ptr, t + 1, nmask)
        following = tl.where(nmask, nbase + nrel, in_window)
        bad |= following - start != count
        bad |= (t % 1024 == 0) & (rel != 0)
        bad |= (t == 0) & (start != 0)
        tl.store(bad_ptr + pid, tl.sum((bad & tmask).to(tl.int32), axis=0))

    @triton.jit
    def _decode_kernel(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, n, tiles, window_low,
                       TPB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * TPB + tl.arange(0, TPB)
        tmask = t < tiles
        base, rel = _tile_start(groups_ptr, tilerel_ptr, t, tmask)
        start = base + rel
        code = _codes(bitmaps_ptr, t, tmask)
        p = tl.arange(0, 64)
        idx = t[:, None] * 64 + p[None, :]
        valid = idx < n
        inside = code != 0
        ones = inside.to(tl.int32)
        rank = tl.cumsum(ones, axis=1) - ones
        h_idx = start[:, None] + rank
        f_idx = t[:, None] * 64 - start[:, None] + p[None, :] - rank
        sm = tl.load(sm_ptr + h_idx, mask=inside & valid, other=0).to(tl.int32)
        fb = tl.load(fb_ptr + f_idx, mask=valid & (code == 0), other=0).to(tl.int32)
        coded = ((sm & 0x80) << 8) | ((window_low - 1 + code) << 7) | (sm & 0x7F)
        tl.store(out_ptr + idx, tl.where(inside, coded, fb).to(tl.int16), mask=valid)


def _stream(frame: torch.Tensor, header: TcaTbeHeader, which: int, dtype: torch.dtype) -> torch.Tensor:
    """A stream of the frame as a typed view (streams are 16-byte aligned); a one-element dummy
    for an empty stream, which the kernels never touch but must be handed a pointer."""
    offset, length = header.offsets[which], header.lengths[which]
    if not length:
        return torch.zeros(1, dtype=dtype, device=frame.device)
    return frame[offset:offset + length].view(dtype)


def _grid(tiles: int) -> tuple[int]:
    return (max(1, triton.cdiv(tiles, TILES_PER_PROGRAM)),)


def _check_input(t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"kernel input must be contiguous {dtype}, got {t.dtype}")


def encode(x: torch.Tensor, *, checksum: bool) -> torch.Tensor:
    """The reference's frame of bfloat16 ``x``, computed on ``x``'s device by the kernels."""
    from .codec import finish  # the header's one writer

    layout = layout_for(x.dtype)
    n = x.numel()
    if n == 0:  # a header and no streams, window 0 (as the reference's empty histogram picks)
        header = make_header(layout.wire_id, tuple(x.shape), 0, 0)
        return finish(torch.zeros(header.total, dtype=torch.uint8, device=x.device), header, checksum)
    flat = x.detach().contiguous().reshape(-1).view(torch.int16)
    device = flat.device
    tiles = triton.cdiv(n, TILE)
    # Pass 1: the exponent histogram and the window that covers the most elements.
    programs = triton.cdiv(n, HIST_BLOCK * HIST_ITERS)
    partial = torch.empty(programs, 256, dtype=torch.int32, device=device)
    _histogram_kernel[(programs,)](flat, partial, n, BLOCK=HIST_BLOCK, ITERS=HIST_ITERS)
    hist = partial.sum(dim=0, dtype=torch.int64)
    hist[0] -= programs * HIST_BLOCK * HIST_ITERS - n
    sums = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
    window_low = torch.argmax(sums[WINDOW:] - sums[:-WINDOW]).reshape(1)  # first of equal maxima
    # Pass 2: in-window elements per tile, and each tile's start in SIGNMAN.
    counts = torch.empty(tiles, dtype=torch.int32, device=device)
    _count_kernel[_grid(tiles)](flat, window_low, counts, n, tiles, TPB=TILES_PER_PROGRAM, num_warps=NUM_WARPS)
    ends = counts.cumsum(0, dtype=torch.int64)
    low, in_window = torch.cat([window_low, ends[-1:]]).tolist()  # the one wait for the device
    header = make_header(layout.wire_id, tuple(x.shape), low, in_window)
    if header.total >= stored_size(layout, n):
        return encode_stored(x, checksum=checksum)
    starts = ends - counts
    frame = torch.empty(header.total, dtype=torch.uint8, device=device)
    for begin, end in padding_ranges(header):
        frame[begin:end] = 0
    # Pass 3: bitmaps, offsets and both value streams.
    _encode_kernel[_grid(tiles)](
        flat, window_low, starts, _stream(frame, header, Stream.BITMAPS, torch.int32),
        _stream(frame, header, Stream.GROUPS, torch.int64), _stream(frame, header, Stream.TILES, torch.int16),
        _stream(frame, header, Stream.SIGNMAN, torch.uint8), _stream(frame, header, Stream.FALLBACK, torch.int16),
        n, tiles, TPB=TILES_PER_PROGRAM, num_warps=NUM_WARPS)
    return finish(frame, header, checksum)


def check(frame: torch.Tensor, header: TcaTbeHeader) -> None:
    """Check the streams of a frame whose header passed (the stream CRC is the caller's).

    Raises:
        CorruptFrame: offsets the bitmaps contradict, codes past the end, non-zero padding.
    """
    tiles = header.tiles
    if not tiles:
        return
    if frame.data_ptr() % 16:
        frame = frame.clone()
    grid = _grid(tiles)
    bad = torch.empty(grid[0], dtype=torch.int32, device=frame.device)
    _check_kernel[grid](_stream(frame, header, Stream.BITMAPS, torch.int32),
                        _stream(frame, header, Stream.GROUPS, torch.int64),
                        _stream(frame, header, Stream.TILES, torch.int16), bad, header.numel, tiles,
                        header.in_window, TPB=TILES_PER_PROGRAM, num_warps=NUM_WARPS)
    problems = bad.sum(dtype=torch.int64)
    ranges = padding_ranges(header)
    if ranges:
        problems = problems + torch.cat([frame[a:b] for a, b in ranges]).ne(0).sum()
    if int(problems):
        raise CorruptFrame("tile offsets, bitmaps or padding disagree (the streams are inconsistent)")


def decode_into(frame: torch.Tensor, header: TcaTbeHeader, out: torch.Tensor) -> torch.Tensor:
    """Decode a frame whose header passed into the contiguous bfloat16 ``out`` (same device,
    ``header.numel`` elements); ``out`` is written only after ``check`` found nothing wrong.

    Raises:
        CorruptFrame: as ``check``.
        ValueError: ``out`` is not a contiguous bfloat16 tensor of the frame's size on its device.
    """
    _check_input(out, torch.bfloat16)
    if out.numel() != header.numel or out.device != frame.device or frame.numel() != header.total:
        raise ValueError("out must hold the frame's elements on the frame's device")
    if frame.data_ptr() % 16:  # a frame cut from a receive buffer: the typed stream views need alignment
        frame = frame.clone()
    check(frame, header)
    if not header.tiles:
        return out
    _decode_kernel[_grid(header.tiles)](
        _stream(frame, header, Stream.BITMAPS, torch.int32), _stream(frame, header, Stream.GROUPS, torch.int64),
        _stream(frame, header, Stream.TILES, torch.int16), _stream(frame, header, Stream.SIGNMAN, torch.uint8),
        _stream(frame, header, Stream.FALLBACK, torch.int16), out.view(torch.int16).reshape(-1),
        header.numel, header.tiles, header.window_low, TPB=TILES_PER_PROGRAM, num_warps=NUM_WARPS)
    return out

