"""GPU path of the entropy codec: CuPy (NVRTC) kernels in ``entropy_cuda.cu``, one warp per
chunk, writing the reference's bytes.

Encode: one pass codes every chunk into a slot of its own and writes the raw stream straight
into the frame's buffer; a one-block scan sums the word counts, and a second pass places the
frame in that buffer from the total (its raw stream where the coder wrote it) and moves the
tables, each chunk's words and counts into place. Then one read of the total (the
call's only synchronization, after all the device's work) and the header. Block ids, where
given, are read by the coder itself (no gathered copy). Decode: one read of the frame's
first bytes (header, tables), the padding check and the scan, the coder into fresh memory,
then a copy into the caller's tensor or cache blocks that the device skips unless every
check passed, and one read of the verdict. The host's time before a call's first launch
idles the GPU, so those paths avoid torch ops and numpy arrays.

The host builds the header and checks the tables; a stream CRC, where a frame asks for one,
is computed on a host copy (the registry's frames carry none).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checksum import crc32c
from ..errors import BlockOutOfRange, CorruptFrame, OutputMismatch
from ..format import FrameCodec, stored_size
from .. import prefix as frame_prefix
from ..launch import in_context, kernel_parameters
from ..staging import Pending, current_stream, optional_cupy, read_to_host, start_read
from .codebook import EntropyCodebook
from . import huffman
from .format import (FRAME_ID, HEADER_BODY, HEADER_SIZE, LANES, WORDS_LENGTH_AT, EntropyHeader, Stream, align,
                     chunk_caps, chunk_raw_words, make_header, num_chunks, pack_map, pack_tables, parse_header, parse_tables,
                     word_cap)
from .huffman import CodeTables, code_tables
from .symbols import Geometry, SymbolLayout, for_dtype

_SOURCE = Path(__file__).with_name("entropy_cuda.cu")
THREADS = 1024  # per block of the coders: one block of 32 warps per SM shares the tables
PTAB_MAX = 1 << 27  # per-position table ids for periods up to 128 Mi elements (one byte each)
PTAB4_MIN, PTAB4_MAX = 128, 1 << 24  # periods the fast decode takes (ptab4: four bytes a position)
COMPACT_FROM = 1 << 15  # longer periods of whole token rows take ptab4 a word per context
_LAYOUTS = ((9, 7, 2), (6, 10, 2), (8, 0, 1))  # (coded bits, raw bits, bytes): 16-bit floats, FP8
_PREFIX = 64 << 10  # bytes decode reads first: header, tables and map of common frames
_MAX_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.cache
def available() -> bool:
    """True when CUDA and CuPy are both usable."""
    return optional_cupy() is not None and torch.cuda.is_available()


@functools.cache
def _module(device_index: int):
    cupy = optional_cupy()
    names = [f"entropy_{kind}<{s},{r},{b},{fast}>" for s, r, b in _LAYOUTS for kind in ("encode", "decode")
             for fast in (0, 1, 2)]
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++17",), name_expressions=names)
        module.compile()
    return module


@dataclass(frozen=True)
class _Kernel:
    """A compiled kernel launched through ``cuLaunchKernel`` (CuPy's argument conversion costs
    tens of microseconds a call); every argument is passed as 8 bytes."""

    handle: int
    threads: int
    device_index: int
    owner: object  # CuPy's RawKernel, which keeps the module loaded

    def __call__(self, stream: int, grid: int | tuple[int, int], args: tuple[int, ...], smem: int = 0) -> None:
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        in_context(self.device_index, optional_cupy().cuda.driver.launchKernel, self.handle, max(1, gx), gy, 1,
                    self.threads, 1, 1, smem, stream, kernel_parameters(args), 0)


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, name: str, threads: int = THREADS) -> _Kernel:
    """The kernel ``name``; the coders' fast builds may take all the shared memory a block can."""
    cupy = optional_cupy()
    function = _module(device_index).get_function(name)
    with cupy.cuda.Device(device_index):
        handle = function.kernel.ptr
        if name.endswith((",1>", ",2>")):
            cupy.cuda.driver.funcSetAttribute(handle, _MAX_SHARED, _device_limits(device_index)[1])
    return _Kernel(handle, threads, device_index, function)


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int]:
    """(SMs, shared memory a block may opt in to)."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:
        with optional_cupy().cuda.Device(device_index) as dev:
            smem = dev.attributes["MaxSharedMemoryPerBlockOptin"]
    return props.multi_processor_count, int(smem)


@dataclass(frozen=True)
class _Tables:
    """A codebook's tables on one device, in the kernels' layouts (entropy_cuda.cu)."""

    enc: torch.Tensor  # (tables, 2**S) u32: code | length << 16, ESC_FLAG for the escape's
    lut: torch.Tensor  # (tables, 2**CODE_BITS) u16: symbol << LEN_BITS | length
    cmap: torch.Tensor  # context map
    ptab: torch.Tensor | None  # table of each position of one period, where short enough
    ptab4: torch.Tensor | None  # tables of a context's position and the next three 32 on (``_ptab4``)
    p4: tuple[int, int]  # ptab4's (hi, lo): (0, 0) a word per position, else per context (``_ptab4``)
    enc_smem: int  # bytes of shared memory the fast encoder needs, 0 if it does not fit
    dec_smem: int  # likewise the fast decoder

    def geo(self, ct: CodeTables) -> tuple[int, ...]:
        g = ct.geometry
        return (self.ptab.data_ptr() if self.ptab is not None else 0, self.cmap.data_ptr(), g.period,
                g.tokens * g.inner, g.inner)


def _tables_on(ct: CodeTables, device: torch.device) -> _Tables:
    key = ("gpu", str(device))
    if key not in ct._cache:
        g = ct.geometry
        ptab = None
        cmap = torch.from_numpy(ct.context_map.astype(np.uint8)).to(device)
        ptab4, p4 = None, (0, 0)
        if 32 <= g.period <= PTAB_MAX:
            j = torch.arange(g.period, dtype=torch.int64, device=device)
            ptab = cmap[(j // (g.tokens * g.inner)) * g.inner + j % g.inner]
            ptab4, p4 = _ptab4(g, ptab)
        enc = torch.from_numpy(huffman.encode_table(ct).view(np.int32)).to(device)
        lut = torch.from_numpy(huffman.decode_lut(ct).view(np.int16)).to(device)
        _, limit = _device_limits(device.index or 0)
        enc_bytes, dec_bytes = enc.numel() * 4, lut.numel() * 2
        ct._cache[key] = _Tables(enc, lut, cmap, ptab, ptab4, p4,
                                 enc_bytes if enc_bytes <= limit else 0, dec_bytes if dec_bytes <= limit else 0)
    return ct._cache[key]


def tables_ready(ct: CodeTables, device: torch.device) -> None:
    """``ct``'s tables built on ``device`` ahead of its first call (from another thread: its
    stream is waited for, so a coder on any stream finds them written)."""
    _tables_on(ct, device)
    torch.cuda.current_stream(device).synchronize()


def _ptab4(g: Geometry, ptab: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, int]]:
    """The fast coders' tables four steps a word (``TableCursor``) and its (hi, lo): a word per
    position of the period, (0, 0), or for a large period of whole token rows of a power of two
    times 128 positions, a word per context (the contexts' first row's positions)."""
    rows, row = g.tokens, g.inner
    compact = g.period > COMPACT_FROM and rows > 1 and row % 128 == 0 and _pow2(row) and _pow2(rows)
    if g.period < PTAB4_MIN or (g.period > PTAB4_MAX and not compact):
        return None, (0, 0)
    wide = ptab.to(torch.int32)
    if compact:
        c = torch.arange(g.outer * row, dtype=torch.int64, device=ptab.device)
        at = (c // row) * (row * rows) + c % row
        return sum(wide[at + 32 * k] << (8 * k) for k in range(4)), ((row * rows).bit_length() - 1,
                                                                      row.bit_length() - 1)
    return sum(wide.roll(-32 * k) << (8 * k) for k in range(4)), (0, 0)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _coder(kind: str, sym: SymbolLayout, device_index: int, tabs: _Tables, nchunks: int) -> tuple[_Kernel, int]:
    """The fast build (tables in shared memory; ptab4 a word per position or per context) or the
    generic one, and its grid."""
    smem = tabs.enc_smem if kind == "encode" else tabs.dec_smem
    fast = (2 if tabs.p4[0] else 1) if smem else 0
    name = f"entropy_{kind}<{sym.sym_bits},{sym.raw_bits},{sym.layout.itemsize},{fast}>"
    sms, _ = _device_limits(device_index)
    per_sm = 1 if smem else 2
    return _kernel(device_index, name), min(-(-nchunks * 32 // THREADS), sms * per_sm)


def takes_blocks(cache: torch.Tensor) -> bool:
    """Whether the encoder reads ``cache``'s blocks in place: contiguous, whole steps of 32
    elements per block."""
    block = cache[0].numel() if cache.dim() and cache.shape[0] else 0
    return cache.is_contiguous() and block > 0 and block % LANES == 0 and block < 1 << 31


@dataclass(frozen=True)
class _EncodePlan:
    """What encoding a tensor of one shape with one codebook needs besides the data."""

    sym: SymbolLayout
    n: int
    nchunks: int
    cap: int
    cap_last: int
    raw_at: int  # where the coder writes the raw stream in the buffer
    buffer: int  # bytes: the largest frame, and room for the raw words of a partial last step
    between: bytes  # the frame's bytes from the header's end to the counts (tables, map, padding)
    empty: EntropyHeader  # the header with no words, the others' template
    prefix_on: dict  # device -> the empty header and ``between`` there, for the assemble kernel


def _encode_plan(ct: CodeTables, sym: SymbolLayout, shape: tuple[int, ...], chunk: int) -> _EncodePlan:
    key = ("plan", shape, chunk, sym.layout.name)
    if key not in ct._cache:
        empty = make_header(sym, shape, ct, chunk, 0)
        o, ln = empty.offsets, empty.lengths
        n = empty.numel
        caps = chunk_caps(n, chunk, sym)
        raw_at = align(o[Stream.WORDS] + 4 * int(caps.sum()))
        between = np.zeros(o[Stream.COUNTS] - HEADER_SIZE, dtype=np.uint8)
        tables = np.frombuffer(pack_tables(ct), dtype=np.uint8)
        between[o[Stream.TABLES] - HEADER_SIZE:][:tables.size] = tables
        between[o[Stream.MAP] - HEADER_SIZE:][:ln[Stream.MAP]] = np.frombuffer(pack_map(ct), dtype=np.uint8)
        ct._cache[key] = _EncodePlan(sym, n, num_chunks(n, chunk), word_cap(chunk, sym),
                                     int(caps[-1]) if caps.size else 0, raw_at, raw_at + ln[Stream.RAW] + 16,
                                     between.tobytes(), empty, {})
    return ct._cache[key]


def encode(source: torch.Tensor, ids: torch.Tensor | None, shape: tuple[int, ...], book: EntropyCodebook, *,
           checksum: bool, chunk: int, blocks: int = 0) -> torch.Tensor | None:
    """The reference's frame of ``source`` (flat contiguous, ``shape`` elements), or of the
    blocks ``source[ids]`` of a contiguous cache of ``blocks`` blocks (``takes_blocks``); None
    where a stored frame would not be larger.

    Raises:
        BlockOutOfRange: a block id outside the cache (checked on the device; nothing read).
    """
    return start_encode(source, ids, shape, book, checksum=checksum, chunk=chunk, blocks=blocks).result()


def start_encode(source: torch.Tensor, ids: torch.Tensor | None, shape: tuple[int, ...], book: EntropyCodebook, *,
                 checksum: bool, chunk: int, blocks: int = 0) -> Pending[torch.Tensor | None]:
    """``encode`` launched on the current stream: the frame once the stream has run.

    The device checks the block ids, places the frame from the word total itself and completes
    its header, so the host's one read (the total, which the frame's size needs) comes after all
    of the device's work and nothing is left to write after it."""
    sym = for_dtype(source.dtype)
    device = source.device
    ct = code_tables(book)
    plan = _encode_plan(ct, sym, tuple(shape), chunk)
    n, nchunks, stream = plan.n, plan.nchunks, current_stream(device)
    buf = torch.empty(plan.buffer, dtype=torch.uint8, device=device)
    if not nchunks:
        return Pending.done(_encoded(plan, buf, sym, 0, checksum))
    tabs = _tables_on(ct, device)
    prefix = plan.prefix_on.get(device)
    if prefix is None:
        prefix = plan.prefix_on.setdefault(device, torch.frombuffer(
            bytearray(plan.empty.pack() + plan.between), dtype=torch.uint8).to(device))
    # one allocation: word sums (int64), the ids' verdict (int32 and padding), counts, slots
    # (each the chunk's cap of words)
    stride = plan.cap
    scratch = torch.empty(nchunks * (8 + 4 + 4 * stride) + 24, dtype=torch.uint8, device=device)
    cum = scratch.data_ptr()
    err = cum + 8 * nchunks if ids is not None else 0
    counts_at = cum + 8 * nchunks + 8
    slots = counts_at + 4 * nchunks
    index = device.index or 0
    block = source[0].numel() if ids is not None else 1
    if ids is not None:
        _kernel(index, "entropy_check_ids", 1024)(stream, 1, (ids.data_ptr(), ids.numel(), blocks, 0, err, 1))
    kernel, grid = _coder("encode", sym, index, tabs, nchunks)
    ptab4 = tabs.ptab4.data_ptr() if tabs.ptab4 is not None else 0
    kernel(stream, grid, (
        source.data_ptr(), ids.data_ptr() if ids is not None else 0, block, n, chunk, nchunks,
        tabs.enc.data_ptr(), tabs.enc.numel(), *tabs.geo(ct), ptab4, *tabs.p4, slots, stride, counts_at,
        buf.data_ptr() + plan.raw_at, chunk_raw_words(chunk // LANES, sym.raw_bits), err), tabs.enc_smem)
    _kernel(index, "entropy_scan", 1024)(stream, 1, (counts_at, nchunks, cum) + (0,) * 14)
    o = plan.empty.offsets
    _kernel(index, "entropy_assemble", 256)(stream, min(-(-nchunks // 8), 1 << 16), (
        slots, counts_at, cum, stride, nchunks, buf.data_ptr(), plan.raw_at, prefix.data_ptr(), HEADER_BODY,
        WORDS_LENGTH_AT, prefix.numel(), o[Stream.COUNTS], o[Stream.WORDS],
        int(plan.empty.lengths[Stream.RAW] > 0), err))

    def finish(read: np.ndarray) -> torch.Tensor | None:
        if ids is not None and int(read[8:12].view(np.int32)[0]):
            raise BlockOutOfRange(f"block ids must be in 0..{blocks - 1}")
        return _encoded(plan, buf, sym, int(read[:8].view(np.int64)[0]), checksum)

    return start_read(scratch, 16, offset=8 * (nchunks - 1)).then(finish)


def _encoded(plan: _EncodePlan, buf: torch.Tensor, sym: SymbolLayout, total_words: int,
             checksum: bool) -> torch.Tensor | None:
    """The frame the device placed in ``buf`` for ``total_words`` words, or None where a stored
    frame would not be larger."""
    header = plan.empty.with_words(total_words)
    if header.total >= stored_size(sym.layout, plan.n):
        return None
    start = plan.raw_at - header.offsets[Stream.RAW]
    frame = buf[start:start + header.total]
    if not plan.nchunks:  # else the device wrote the header
        frame[:header.offsets[Stream.COUNTS]].copy_(
            torch.frombuffer(bytearray(header.pack() + plan.between), dtype=torch.uint8))
    if checksum:
        header = header.with_crc(crc32c(frame[HEADER_SIZE:].cpu().numpy().data))
        frame[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    return frame


_BOOKS: dict[tuple, tuple[bytes, CodeTables]] = {}
_BOOKS_LOCK = threading.Lock()


def _frame_tables(header: EntropyHeader, table_bytes: bytes, map_bytes: bytes) -> CodeTables:
    """The frame's code tables, parsed once per distinct tables and element geometry (frames of
    one codebook repeat them), so that their device tables are built once too. Found by a CRC
    of the bytes (hashing tens of KiB in Python costs the call more) and then compared whole."""
    both = table_bytes + map_bytes
    key = (header.sym.layout.name, header.code_bits, header.tables, header.geometry, header.element_geometry,
           len(table_bytes), crc32c(both))
    with _BOOKS_LOCK:
        held = _BOOKS.get(key)
    if held is not None and held[0] == both:
        return held[1]
    ct = parse_tables(header, table_bytes, map_bytes)
    with _BOOKS_LOCK:
        if len(_BOOKS) >= 32:
            _BOOKS.clear()
        _BOOKS[key] = (both, ct)
    return ct


def read_prefix(frame: torch.Tensor) -> np.ndarray:
    """The frame's first bytes (up to 64 KiB) after the checks of ``registry.codec_id``.

    Raises:
        CorruptFrame: not a 1-D uint8 tensor, too short, or wrong magic.
    """
    frame_prefix.check_frame(frame)
    prefix = read_to_host(frame.contiguous(), min(frame.numel(), _PREFIX), current_stream(frame.device))
    frame_prefix.check_magic(prefix[:4].tobytes())
    return prefix


def is_stored(prefix: np.ndarray) -> bool:
    """Whether the frame is a stored one (codec 0); else it must be an entropy frame.

    Raises:
        CorruptFrame: another codec's frame.
    """
    codec = int(prefix[frame_prefix.CODEC_ID_AT])
    if codec not in (int(FrameCodec.STORED), FRAME_ID):
        raise CorruptFrame(f"codec id {codec} is not an entropy (or stored) frame")
    return codec == int(FrameCodec.STORED)


def header_of(frame: torch.Tensor, prefix: np.ndarray) -> EntropyHeader:
    return parse_header(prefix[:HEADER_SIZE].tobytes(), frame.numel())


def _decode(frame: torch.Tensor, header: EntropyHeader, prefix: np.ndarray, ids: torch.Tensor | None = None,
            blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The frame's elements decoded into fresh memory (16-byte aligned, padded to 16 bytes) and
    the device's verdict (0: every check passed; with ``ids``, also checked against a cache of
    ``blocks`` blocks), neither read yet.

    Raises:
        CorruptFrame: a check the host makes (stream CRC, tables).
    """
    device, stream = frame.device, current_stream(frame.device)
    sym, n = header.sym, header.numel
    o, ln = header.offsets, header.lengths
    if not frame.is_contiguous() or frame.data_ptr() % 16:
        frame = frame.clone()
    if header.stream_crc is not None and crc32c(frame[HEADER_SIZE:].cpu().numpy().data) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    if len(prefix) < o[Stream.COUNTS]:
        prefix = read_to_host(frame, o[Stream.COUNTS], stream)
    ct = _frame_tables(header, prefix[o[Stream.TABLES]:][:ln[Stream.TABLES]].tobytes(),
                       prefix[o[Stream.MAP]:][:ln[Stream.MAP]].tobytes())
    tabs = _tables_on(ct, device)
    itemsize = sym.layout.itemsize
    nchunks = header.nchunks
    size = (n * itemsize + 15) // 16 * 16 or 16
    out = torch.empty(size + 8 * nchunks + 8, dtype=torch.uint8, device=device)  # then word sums, err
    cum, err = out.data_ptr() + size, out[size + 8 * nchunks:].view(torch.int32)  # err: set by entropy_scan
    base = frame.data_ptr()
    gaps, end = [], HEADER_SIZE  # (first byte, length) of the padding before each stream after the tables
    for off, length in zip(o, ln):
        gaps += [end, max(0, min(off, frame.numel()) - end)]
        end = max(end, off + length)
    gaps = gaps[2:] + [0, 0]  # the scan checks five gaps; this format has four
    _kernel(device.index or 0, "entropy_scan", 1024)(stream, 1, (
        base + o[Stream.COUNTS], nchunks, cum, base, *gaps, o[Stream.RAW] + ln[Stream.RAW] - 1, 0, err.data_ptr()))
    if ids is not None and ids.numel():  # after the scan, which sets err rather than adding to it
        hits = torch.zeros(max(blocks, 1), dtype=torch.int32, device=device)
        _kernel(device.index or 0, "entropy_check_ids", 1024)(stream, 1, (
            ids.data_ptr(), ids.numel(), blocks, hits.data_ptr(), err.data_ptr(), 0))
    if nchunks:
        cap, cap_last = word_cap(header.chunk, sym), word_cap(n - (nchunks - 1) * header.chunk, sym)
        kernel, grid = _coder("decode", sym, device.index or 0, tabs, nchunks)
        ptab4 = tabs.ptab4.data_ptr() if tabs.ptab4 is not None else 0
        kernel(stream, grid, (
            base + o[Stream.WORDS], ln[Stream.WORDS] // 4, base + o[Stream.COUNTS], cum, tabs.lut.data_ptr(),
            tabs.lut.numel() // 2, tabs.enc.data_ptr(), ptab4, *tabs.p4, *tabs.geo(ct), n, header.chunk, nchunks, cap,
            cap_last, base + o[Stream.RAW] if ln[Stream.RAW] else 0, chunk_raw_words(header.chunk // LANES, sym.raw_bits),
            out.data_ptr(), err.data_ptr()), tabs.dec_smem)
    return out, err


def _verdict(err: torch.Tensor | np.ndarray, blocks: int = 0) -> None:
    """Raise what the device found (``err`` on the device, or read already)."""
    code = int((read_to_host(err, 4, current_stream(err.device)) if isinstance(err, torch.Tensor) else err)
               .view(np.int32)[0])
    if code & 2:
        raise BlockOutOfRange(f"block ids must be in 0..{blocks - 1}")
    if code & 4:
        raise OutputMismatch("block ids repeat")
    if code:
        raise CorruptFrame("coded streams do not decode to their end (corrupt counts, words, escapes "
                           "or padding)")


def _scatter(out: torch.Tensor, dst: int, ids: torch.Tensor | None, block_bytes: int, nblocks: int,
             err: torch.Tensor) -> None:
    """Decoded bytes into ``dst`` (blocks ``ids``), skipped by the device unless ``err`` is 0."""
    pieces = block_bytes // 16
    threads = 256
    gx = min(-(-pieces // (threads * 4)), 1 << 20)
    gy = min(nblocks, 65535)
    _kernel(out.device.index or 0, "entropy_scatter", threads)(current_stream(out.device), (gx, gy), (
        out.data_ptr(), dst, ids.data_ptr() if ids is not None else 0, block_bytes, nblocks, err.data_ptr()))


def decode(frame: torch.Tensor, header: EntropyHeader, prefix: np.ndarray, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Decode an entropy frame that lives on the GPU (header parsed from ``prefix``), into a new
    tensor or into ``out`` (checked by the caller: same dtype and element count).

    Raises:
        CorruptFrame: any check fails; nothing of the caller's is written.
    """
    decoded, err = _decode(frame, header, prefix)
    nbytes = header.numel * header.sym.layout.itemsize
    if (out is not None and out.device == frame.device and out.is_contiguous() and out.data_ptr() % 16 == 0
            and nbytes % 16 == 0 and nbytes):
        _scatter(decoded, out.data_ptr(), None, nbytes, 1, err)
        _verdict(err)
        return out
    _verdict(err)
    sym = header.sym
    result = decoded[:nbytes].view(torch.int16 if sym.layout.itemsize == 2 else torch.uint8)
    result = result.view(sym.layout.dtype).view(header.shape)
    return result if out is None else out.copy_(result.view(out.shape))


def decode_blocks(frame: torch.Tensor, header: EntropyHeader, prefix: np.ndarray, cache: torch.Tensor,
                  ids: torch.Tensor) -> None:
    """Decode an entropy frame on the GPU into ``cache[ids]`` (checked by the caller).

    Raises:
        CorruptFrame: any check fails; nothing is written.
    """
    decoded, err = _decode(frame, header, prefix)
    itemsize = header.sym.layout.itemsize
    block_bytes = (cache[0].numel() if ids.numel() else 0) * itemsize
    if scatters(cache, block_bytes) and ids.numel():
        _scatter(decoded, cache.data_ptr(), ids, block_bytes, ids.numel(), err)
        _verdict(err)
        return
    _verdict(err)
    if not ids.numel():
        return
    bits = torch.int16 if itemsize == 2 else torch.uint8
    blocks = decoded[:header.numel * itemsize].view(bits).view(ids.numel(), *cache.shape[1:])
    cache.view(bits).index_copy_(0, ids, blocks)


def scatters(cache: torch.Tensor, block_bytes: int) -> bool:
    """Whether decoded blocks go into ``cache`` by the scatter kernel (16-byte pieces)."""
    return cache.is_contiguous() and cache.data_ptr() % 16 == 0 and block_bytes % 16 == 0 and block_bytes > 0


def start_decode_blocks(frame: torch.Tensor, header: EntropyHeader, prefix: np.ndarray, cache: torch.Tensor,
                        ids: torch.Tensor) -> Pending[None]:
    """``decode_blocks`` launched on the current stream, the block ids (unchecked by the
    caller) checked on the device too: done once the stream has run, raising as
    ``decode_blocks`` does (and BlockOutOfRange / OutputMismatch for bad ids); nothing is written
    unless every check passed. The caller knows ``scatters(cache, ...)`` holds."""
    blocks = cache.shape[0]
    decoded, err = _decode(frame, header, prefix, ids, blocks)
    block_bytes = cache[0].numel() * header.sym.layout.itemsize
    _scatter(decoded, cache.data_ptr(), ids, block_bytes, ids.numel(), err)

    return start_read(err, 4).then(lambda read: _verdict(read, blocks))
