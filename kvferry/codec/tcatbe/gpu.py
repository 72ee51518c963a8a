"""GPU path of tca-tbe: Triton kernels writing and reading the reference's bytes.

Encode is three passes over the tensor: an exponent histogram (per-program partial histograms,
summed and windowed on the device), per-tile in-window counts, and after an exclusive prefix
sum of the counts (``torch.cumsum``) a scatter pass that writes the bitmaps, both offset streams,
SIGNMAN and FALLBACK. The frame's size depends on the data, so encode reads two numbers back
(window and in-window count) once, between the second and third pass.

Decode runs the CUDA kernels of ``cuda.py`` where CuPy is importable (``DECODE_CUDA``): the same
two passes after a header check on the device (``decode_unparsed``: the host need not read the
header first), a decode kernel whose warps read and write contiguous bytes, and a path that
decodes straight into scattered cache blocks (``decode_blocks_into``). Otherwise, and under the
interpreter, the Triton kernels below: two kernels and one wait. The check kernel reads only the
bitmaps and the offsets (26 bytes per 64 elements, popc of each tile's in-window mask): offsets
agree with the popcounts, no codes past the end, zero padding; it sets a flag on the device if
anything is wrong. The decode kernel reads that flag first and, if it is set, reads and writes
nothing; otherwise each element finds its value from its tile's start and the popc of the
in-window bits below it, constant time and branch-free (``_decode_bytes_kernel``: what depends on
a 32-bit word or a byte of the bitmaps is computed once for its 32 or 8 elements). The host reads
the flag once, after both kernels, and raises ``CorruptFrame`` with ``out`` untouched. On an H200
(1 GiB of real KV) the Triton check costs ~0.14 ms, the Triton decode kernel ~1.0 ms.

Works on CPU tensors under ``TRITON_INTERPRET=1`` too (the tests run it that way).
"""

from __future__ import annotations

import functools

import torch

from ..dtypes import layout_for
from ..errors import CorruptFrame, InvalidArgument, OutputMismatch
from ..format import stored_size
from ..frames import encode_stored
from . import cuda
from .format import GROUP_TILES, PLANES, TILE, WINDOW, Stream, TcaTbeHeader, finish, make_header, padding_ranges

try:
    import triton
    import triton.language as tl
except ImportError:  # the codec then uses the reference by way of host copies
    triton = None

assert (TILE, PLANES, GROUP_TILES) == (64, 3, 1024)  # the kernels spell these out
TILES_PER_PROGRAM = 16     # encode: 1024 elements a program (bench/tcatbe_gpu_check.py sweeps these)
NUM_WARPS = 4
DECODE_TILES_PER_PROGRAM = 16   # decode: 1024 elements a program (H200: 16x4 and 16x2 best of 16..128 x 2..8)
DECODE_NUM_WARPS = 4
DECODE_CUDA = True         # cuda.py's kernels where CuPy is importable (H200, 1 GiB: docs/benchmarks.md)
DECODE_BYTES = True        # _decode_bytes_kernel (else _decode_kernel, one word of 32 elements at a time)
DECODE_ITERS = 1           # runs of DECODE_TILES_PER_PROGRAM tiles a decode program takes in turn
CHECK_TILES_PER_PROGRAM = 256   # the check reads 26 bytes a tile: many tiles a program
CHECK_NUM_WARPS = 4
POPC_ASM = True            # the popc instruction on a GPU (SWAR count otherwise and under the interpreter)
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
    def _popc(x, ASM: tl.constexpr):
        """Set bits of each int32 (the hardware's popc on a GPU, a SWAR count under the interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
        else:
            u = x.to(tl.uint32, bitcast=True)
            u = u - ((u >> 1) & 0x55555555)
            u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
            u = (u + (u >> 4)) & 0x0F0F0F0F
            u = u + (u >> 8)
            u = u + (u >> 16)
            return (u & 0x3F).to(tl.int32)

    @triton.jit
    def _tiles(TPB: tl.constexpr, WIDE: tl.constexpr):
        """This program's tile numbers (int64 only where element indices may pass 2^31)."""
        if WIDE:
            return tl.program_id(0).to(tl.int64) * TPB + tl.arange(0, TPB)
        else:
            return tl.program_id(0) * TPB + tl.arange(0, TPB)

    @triton.jit
    def _tile_start(groups_ptr, tilerel_ptr, t, mask, WIDE: tl.constexpr):
        """In-window elements before each tile t: GROUPS[t // 1024] + TILES[t]."""
        base = tl.load(groups_ptr + t // 1024, mask=mask, other=0)
        rel = tl.load(tilerel_ptr + t, mask=mask, other=0).to(tl.int32) & 0xFFFF
        if not WIDE:
            base = base.to(tl.int32)
        return base, rel

    @triton.jit
    def _encode_kernel(x_ptr, low_ptr, starts_ptr, bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr,
                       n, tiles, TPB: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
        """Each tile as two 32-element words (as the decoder): three plane words by a sum of
        disjoint bits, an element's rank in SIGNMAN by popc of the in-window bits below it."""
        t = _tiles(TPB, WIDE)
        tmask = t < tiles
        w = tl.arange(0, 2)[None, :]
        s = tl.arange(0, 32)[None, None, :]
        ebase = t[:, None] * 64 + w * 32
        idx = ebase[:, :, None] + s
        valid = idx < n
        v = tl.load(x_ptr + idx, mask=valid, other=0).to(tl.int32)
        rel = ((v >> 7) & 0xFF) - tl.load(low_ptr).to(tl.int32)
        inside = (rel >= 0) & (rel < 7) & valid
        code = tl.where(inside, rel + 1, 0)
        m2 = tmask[:, None]
        wi = t[:, None] * 6 + w
        mword = tl.sum(inside.to(tl.int32) << s, axis=2)  # bits are disjoint: the sums are ORs
        for k in tl.static_range(3):
            tl.store(bitmaps_ptr + wi + 2 * k, tl.sum(((code >> k) & 1) << s, axis=2), mask=m2)
        start = tl.load(starts_ptr + t, mask=tmask, other=0)
        group_start = tl.load(starts_ptr + (t // 1024) * 1024, mask=tmask, other=0)
        tl.store(tilerel_ptr + t, (start - group_start).to(tl.int16), mask=tmask)  # u16 bits
        tl.store(groups_ptr + t // 1024, start, mask=tmask & (t % 1024 == 0))
        if not WIDE:
            start = start.to(tl.int32)
        lo_count = tl.sum(tl.where(w == 0, _popc(mword, ASM), 0), axis=1)
        wstart = start[:, None] + tl.where(w == 1, lo_count[:, None], 0)  # in-window before the word
        r = _popc(mword[:, :, None] & ((1 << s) - 1), ASM)
        h_idx = wstart[:, :, None] + r
        f_idx = (ebase - wstart)[:, :, None] + s - r
        sm = ((v >> 8) & 0x80) | (v & 0x7F)
        tl.store(sm_ptr + h_idx, sm.to(tl.uint8), mask=inside)
        tl.store(fb_ptr + f_idx, v.to(tl.int16), mask=valid & (code == 0))

    @triton.jit
    def _check_kernel(bitmaps_ptr, groups_ptr, tilerel_ptr, frame_ptr, bad_ptr, n, tiles, in_window,
                      pad0, pad1, pad2, pad3, pad4, pad5, pad6, pad7,
                      TPB: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
        """Sets *bad_ptr when any of this program's tiles has offsets its popcount contradicts,
        codes past the end, or (program 0) the padding between streams is not zero. Reads only
        the bitmaps and the offsets: 26 bytes per 64 elements, as whole 32-bit words."""
        t = _tiles(TPB, WIDE)
        tmask = t < tiles
        w = tl.arange(0, 2)[None, :]
        wi = t[:, None] * 6 + w
        m2 = tmask[:, None]
        mword = (tl.load(bitmaps_ptr + wi, mask=m2, other=0) | tl.load(bitmaps_ptr + wi + 2, mask=m2, other=0)
                 | tl.load(bitmaps_ptr + wi + 4, mask=m2, other=0))
        count = tl.sum(_popc(mword, ASM), axis=1)
        # No codes for elements past the end of the tensor: bits [limit, 32) of each word clear.
        limit = n - (t[:, None] * 64 + w * 32)
        allowed = tl.where(limit >= 32, -1, tl.where(limit <= 0, 0, (1 << tl.minimum(tl.maximum(limit, 0), 31)) - 1))
        bad = tl.sum(((mword & ~allowed.to(tl.int32)) != 0).to(tl.int32), axis=1) != 0
        base, rel = _tile_start(groups_ptr, tilerel_ptr, t, tmask, True)  # all 64 bits of GROUPS checked
        start = base + rel
        nmask = t + 1 < tiles
        nbase, nrel = _tile_start(groups_ptr, tilerel_ptr, t + 1, nmask, True)
        following = tl.where(nmask, nbase + nrel, in_window)
        bad |= following - start != count
        bad |= (t % 1024 == 0) & (rel != 0)
        bad |= (t == 0) & (start != 0)
        nbad = tl.sum((bad & tmask).to(tl.int32), axis=0)
        if tl.program_id(0) == 0:  # the (at most four, each < 16 bytes) gaps between streams
            k = tl.arange(0, 16)
            z = (tl.load(frame_ptr + pad0 + k, mask=pad0 + k < pad1, other=0)
                 | tl.load(frame_ptr + pad2 + k, mask=pad2 + k < pad3, other=0)
                 | tl.load(frame_ptr + pad4 + k, mask=pad4 + k < pad5, other=0)
                 | tl.load(frame_ptr + pad6 + k, mask=pad6 + k < pad7, other=0))
            nbad += tl.sum((z != 0).to(tl.int32), axis=0)
        tl.atomic_or(bad_ptr, 1, mask=nbad != 0)  # only a bad frame touches the flag

    @triton.jit
    def _decode_kernel(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, bad_ptr, n, tiles,
                       window_low, TPB: tl.constexpr, ITERS: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
        """Each tile as two 32-element words: an element's code is bit s of the word in the three
        planes, its rank popc(M & ((1 << s) - 1)) plus the word's start. A program decodes ITERS
        runs of TPB tiles. Reads and writes nothing when the check kernel flagged the frame."""
        live = tl.where(tl.load(bad_ptr) == 0, tiles, 0)  # no tiles at all if the frame is bad
        w = tl.arange(0, 2)[None, :]
        s = tl.arange(0, 32)[None, None, :]
        below = (1 << s) - 1
        high = (window_low - 1) << 7
        for i in range(ITERS):
            if WIDE:
                t = (tl.program_id(0).to(tl.int64) * ITERS + i) * TPB + tl.arange(0, TPB)
            else:
                t = (tl.program_id(0) * ITERS + i) * TPB + tl.arange(0, TPB)
            tmask = t < live
            wi = t[:, None] * 6 + w
            m2 = tmask[:, None]
            b0 = tl.load(bitmaps_ptr + wi, mask=m2, other=0)
            b1 = tl.load(bitmaps_ptr + wi + 2, mask=m2, other=0)
            b2 = tl.load(bitmaps_ptr + wi + 4, mask=m2, other=0)
            mword = b0 | b1 | b2
            lo_count = tl.sum(tl.where(w == 0, _popc(mword, ASM), 0), axis=1)
            base, rel = _tile_start(groups_ptr, tilerel_ptr, t, tmask, WIDE)
            wstart = (base + rel)[:, None] + tl.where(w == 1, lo_count[:, None], 0)  # in-window before the word
            ebase = t[:, None] * 64 + w * 32                                          # element index of bit 0
            fstart = ebase - wstart                                                   # fallback before the word
            r = _popc(mword[:, :, None] & below, ASM)
            code7 = ((((b0[:, :, None] >> s) & 1) << 7) | (((b1[:, :, None] >> s) & 1) << 8)
                     | (((b2[:, :, None] >> s) & 1) << 9))
            idx = ebase[:, :, None] + s
            valid = (idx < n) & m2[:, :, None]
            inside = code7 != 0
            sm = tl.load(sm_ptr + (wstart[:, :, None] + r), mask=valid & inside, other=0).to(tl.int32)
            fb = tl.load(fb_ptr + (fstart[:, :, None] + s - r), mask=valid & (code7 == 0), other=0).to(tl.int32)
            coded = ((sm & 0x80) << 8) | (sm & 0x7F) | (high + code7)
            tl.store(out_ptr + idx, tl.where(inside, coded, fb).to(tl.int16), mask=valid)


    @triton.jit
    def _spread(byte):
        """Bit j of a byte moved to bit 4j of an int32."""
        x = (byte | (byte << 12)) & 0x000F000F
        x = (x | (x << 6)) & 0x03030303
        return (x | (x << 3)) & 0x11111111

    @triton.jit
    def _decode_run(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, n, tiles, high, t,
                    TPB: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):
        """Decode tiles t (each as [2 words, 4 bytes, 8 elements]); MASKED: some of them (or
        their elements) are past the end."""
        w = tl.arange(0, 2)[None, :, None]
        sh = tl.arange(0, 4)[None, None, :] * 8
        j = tl.arange(0, 8)[None, None, None, :]
        t3 = t[:, None, None]
        wi = t3 * 6 + w
        tmask = t < tiles
        if MASKED:
            m3 = tmask[:, None, None]
            b0 = tl.load(bitmaps_ptr + wi, mask=m3, other=0)
            b1 = tl.load(bitmaps_ptr + wi + 2, mask=m3, other=0)
            b2 = tl.load(bitmaps_ptr + wi + 4, mask=m3, other=0)
        else:
            b0 = tl.load(bitmaps_ptr + wi)
            b1 = tl.load(bitmaps_ptr + wi + 2)
            b2 = tl.load(bitmaps_ptr + wi + 4)
        mword = b0 | b1 | b2                                                   # [TPB, 2, 1]
        lo_count = tl.sum(tl.where(w == 0, _popc(mword, ASM), 0), axis=1)      # [TPB, 1]
        base = tl.load(groups_ptr + t // 1024, mask=tmask, other=0)
        rel = tl.load(tilerel_ptr + t, mask=tmask, other=0).to(tl.int32) & 0xFFFF
        if not WIDE:
            base = base.to(tl.int32)
        wstart = (base + rel)[:, None, None] + tl.where(w == 1, lo_count[:, None, :], 0)
        qstart = wstart + _popc(mword & ((1 << sh) - 1), ASM)                  # in-window before byte q
        ebase = t3 * 64 + w * 32 + sh                                          # [TPB, 2, 4]
        fstart = ebase - qstart
        mbyte = (mword >> sh) & 0xFF
        nib = (_spread((b0 >> sh) & 0xFF) | (_spread((b1 >> sh) & 0xFF) << 1)
               | (_spread((b2 >> sh) & 0xFF) << 2))
        code = (nib[:, :, :, None] >> (j * 4)) & 7
        r = _popc(mbyte[:, :, :, None] & ((1 << j) - 1), ASM)
        idx = ebase[:, :, :, None] + j
        inside = code != 0
        if MASKED:
            valid = idx < n
            sm_mask = valid & inside
            fb_mask = valid & (code == 0)
        else:
            valid = None
            sm_mask = inside
            fb_mask = code == 0
        sm = tl.load(sm_ptr + (qstart[:, :, :, None] + r), mask=sm_mask, other=0).to(tl.int32)
        fb = tl.load(fb_ptr + (fstart[:, :, :, None] + j - r), mask=fb_mask, other=0).to(tl.int32)
        coded = ((sm & 0x80) << 8) | (sm & 0x7F) | (high + (code << 7))
        tl.store(out_ptr + idx, tl.where(inside, coded, fb).to(tl.int16), mask=valid)

    @triton.jit
    def _decode_bytes_kernel(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, bad_ptr, n, tiles,
                             window_low, TPB: tl.constexpr, ITERS: tl.constexpr, WIDE: tl.constexpr,
                             ASM: tl.constexpr):
        """As ``_decode_kernel``, with each tile as 8 bytes of 8 elements [TPB, 2, 4, 8]: what
        depends on the word or the byte is computed once for its 32 or 8 elements (the three
        planes' bits of a byte spread into one 4-bit code per element, the rank of the byte's
        first element), leaving an element a shift and mask for its code and a popc of a byte.
        Runs wholly inside the tensor skip the bounds masks. Reads and writes nothing when the
        check kernel flagged the frame."""
        if tl.load(bad_ptr) == 0:
            high = (window_low - 1) << 7
            for i in range(ITERS):
                if WIDE:
                    first = (tl.program_id(0).to(tl.int64) * ITERS + i) * TPB
                else:
                    first = (tl.program_id(0) * ITERS + i) * TPB
                t = first + tl.arange(0, TPB)
                if (first + TPB) * 64 <= n:
                    _decode_run(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, n, tiles, high, t,
                                TPB, WIDE, ASM, False)
                else:
                    _decode_run(bitmaps_ptr, groups_ptr, tilerel_ptr, sm_ptr, fb_ptr, out_ptr, n, tiles, high, t,
                                TPB, WIDE, ASM, True)


def _stream(frame: torch.Tensor, header: TcaTbeHeader, which: int, dtype: torch.dtype) -> torch.Tensor:
    """A stream of the frame as a typed view (streams are 16-byte aligned); a one-element dummy
    for an empty stream, which the kernels never touch but must be handed a pointer."""
    offset, length = header.offsets[which], header.lengths[which]
    if not length:
        return torch.zeros(1, dtype=dtype, device=frame.device)
    return frame[offset:offset + length].view(dtype)


def _grid(tiles: int, tpb: int = 0) -> tuple[int]:
    return (max(1, triton.cdiv(tiles, tpb or TILES_PER_PROGRAM)),)


def _wide(tiles: int, tpb: int) -> bool:
    """Whether element indices (up to the grid's last tile) may pass int32."""
    return _grid(tiles, tpb)[0] * tpb * 64 >= 1 << 31


def _asm(t: torch.Tensor) -> bool:
    return POPC_ASM and t.is_cuda


def _check_input(t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or not t.is_contiguous():
        raise InvalidArgument(f"kernel input must be contiguous {dtype}, got {t.dtype}")


def encode(x: torch.Tensor, *, checksum: bool) -> torch.Tensor:
    """The reference's frame of bfloat16 ``x``, computed on ``x``'s device by the kernels."""

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
        n, tiles, TPB=TILES_PER_PROGRAM, WIDE=_wide(tiles, TILES_PER_PROGRAM), ASM=_asm(flat), num_warps=NUM_WARPS)
    return finish(frame, header, checksum)


def _launch_check(frame: torch.Tensor, header: TcaTbeHeader) -> torch.Tensor:
    """Launch the check kernel; returns the device flag (int32, non-zero: the frame is bad)."""
    bad = torch.zeros(1, dtype=torch.int32, device=frame.device)
    tiles = header.tiles
    pads = [v for r in padding_ranges(header) for v in r]
    assert len(pads) <= 8 and all(b - a < 16 for a, b in padding_ranges(header))
    pads += [0] * (8 - len(pads))
    tpb = CHECK_TILES_PER_PROGRAM
    _check_kernel[_grid(tiles, tpb)](
        _stream(frame, header, Stream.BITMAPS, torch.int32), _stream(frame, header, Stream.GROUPS, torch.int64),
        _stream(frame, header, Stream.TILES, torch.int16), frame, bad, header.numel, tiles, header.in_window,
        *pads, TPB=tpb, WIDE=_wide(tiles, tpb), ASM=_asm(frame), num_warps=CHECK_NUM_WARPS)
    return bad


def check(frame: torch.Tensor, header: TcaTbeHeader) -> None:
    """Check the streams of a frame whose header passed (the stream CRC is the caller's).

    Raises:
        CorruptFrame: offsets the bitmaps contradict, codes past the end, non-zero padding.
    """
    if not header.tiles:
        return
    if _cuda(frame):
        cuda.check(frame, header)
        return
    if frame.data_ptr() % 16:
        frame = frame.clone()
    if int(_launch_check(frame, header).item()):
        raise CorruptFrame("tile offsets, bitmaps or padding disagree (the streams are inconsistent)")


def decode_into(frame: torch.Tensor, header: TcaTbeHeader, out: torch.Tensor) -> torch.Tensor:
    """Decode a frame whose header passed into the contiguous bfloat16 ``out`` (same device,
    ``header.numel`` elements). The check kernel runs first and leaves a flag on the device;
    the decode kernel reads and writes nothing if it is set, and the one wait for the device
    (reading the flag) comes after both: ``out`` is untouched when this raises.

    Raises:
        CorruptFrame: as ``check``.
        OutputMismatch: ``out`` is not a contiguous bfloat16 tensor of the frame's size on its device.
    """
    _check_input(out, torch.bfloat16)
    if out.numel() != header.numel or out.device != frame.device or frame.numel() != header.total:
        raise OutputMismatch("out must hold the frame's elements on the frame's device")
    if not header.tiles:
        return out
    if _cuda(frame):
        if not cuda.decode_into(frame, out, header.numel, crc_verified=True):
            raise CorruptFrame("the device's header check rejected a header the host accepted")
        return out
    if frame.data_ptr() % 16:  # a frame cut from a receive buffer: the typed stream views need alignment
        frame = frame.clone()
    bad = _launch_check(frame, header)
    tpb, iters = DECODE_TILES_PER_PROGRAM, DECODE_ITERS
    kernel = _decode_bytes_kernel if DECODE_BYTES else _decode_kernel
    kernel[_grid(header.tiles, tpb * iters)](
        _stream(frame, header, Stream.BITMAPS, torch.int32), _stream(frame, header, Stream.GROUPS, torch.int64),
        _stream(frame, header, Stream.TILES, torch.int16), _stream(frame, header, Stream.SIGNMAN, torch.uint8),
        _stream(frame, header, Stream.FALLBACK, torch.int16), out.view(torch.int16).reshape(-1), bad,
        header.numel, header.tiles, header.window_low, TPB=tpb, ITERS=iters, WIDE=_wide(header.tiles, tpb * iters),
        ASM=_asm(frame),
        num_warps=DECODE_NUM_WARPS)
    if int(bad.item()):
        raise CorruptFrame("tile offsets, bitmaps or padding disagree (the streams are inconsistent)")
    return out


def _cuda(frame: torch.Tensor) -> bool:
    return DECODE_CUDA and frame.is_cuda and cuda.available()


def _blocks_fit(frame: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the CUDA kernels can decode ``frame`` straight into blocks of ``cache``."""
    return _cuda(frame) and cache.dtype == torch.bfloat16 and cuda.block_path_fits(cache)


def decode_unparsed(frame: torch.Tensor, out: torch.Tensor) -> bool:
    """Decode a frame (1-D, contiguous) into the contiguous bfloat16 ``out`` on its device, its
    header checked on the device: the GPU starts without waiting for the host to read it. False,
    with nothing written, where the CUDA kernels are not there or decline the frame (another
    codec, another element count, a stream CRC, anything malformed): the host parses it then.

    Raises:
        CorruptFrame: the streams disagree (nothing written).
    """
    return _cuda(frame) and cuda.decode_into(frame, out, out.numel())


def decode_blocks_unparsed(frame: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor,
                           shape: tuple[int, ...]) -> bool:
    """``decode_blocks_into`` with the header checked on the device (the frame must hold
    ``shape``): False, with nothing written, where ``decode_unparsed`` would be.

    Raises:
        CorruptFrame: the streams disagree. BlockOutOfRange: an id outside the cache. OutputMismatch:
            ids repeat. Nothing is written then.
    """
    if not _blocks_fit(frame, cache):
        return False
    return cuda.decode_into(frame, cache, ids.numel() * cache[0].numel(), shape=shape, block_ids=ids)


def decode_blocks_into(frame: torch.Tensor, header: TcaTbeHeader, cache: torch.Tensor, ids: torch.Tensor) -> bool:
    """Decode a frame whose header passed straight into blocks ``ids`` of ``cache`` (int64 ids on
    the cache's device, the frame holding ``len(ids)`` blocks), checking the frame as
    ``decode_into`` does and the ids (range, repeats) in the same kernel, before anything is
    written. False, with nothing done, where the CUDA kernels cannot: the caller checks the ids,
    decodes and scatters then.

    Raises:
        CorruptFrame: as ``check``. BlockOutOfRange: an id outside the cache. OutputMismatch: ids repeat.
    """
    if not (_blocks_fit(frame, cache) and cache.device == frame.device and ids.device == frame.device):
        return False
    if not cuda.decode_into(frame, cache, header.numel, shape=header.shape, block_ids=ids, crc_verified=True):
        raise CorruptFrame("the device's header check rejected a header the host accepted")
    return True
