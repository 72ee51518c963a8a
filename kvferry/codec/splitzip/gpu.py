"""SplitZip on CUDA: launchers for the kernels in ``splitzip_cuda.cu`` (CuPy/NVRTC, compiled on
first use and cached). Produces frames byte-identical to the torch reference in ``reference.py``.

Encode: a dense pass (residual and code streams, escape counts per chunk, escapes spilled per
chunk), per-tile sums of those counts, and a tail pass that finds each chunk's escape offset
from them, compacts escapes, falls back to a stored frame if coding did not pay, and writes
the header. The frame's size stays on the device (``encode_into``); ``encode`` reads it once at
the end. Decode: a header check on the device (so that the host need not read the header
first), a validation pass that also scans the escape counts (one pass, decoupled look-back),
and a dense pass that skips every write if anything failed; one synchronization at the end
reads the verdict. Everything runs on torch's current stream.

The dense passes come in two builds: lean kernels for the common case (whole chunks inside
cache blocks, 16-byte aligned memory), which run at the copy-traffic ceiling, and general ones
for everything else; both write the same bytes.

The host's share of a call is kept small, since it bounds small-chunk throughput and the GPU
waits on it between calls: plans per shape, one scratch allocation per call and no memset
before the first kernel, launches through ``cuLaunchKernel`` with a reused parameter block,
device reads through pinned memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..checksum import crc32c
from ..dtypes import LAYOUTS, FloatLayout
from ..errors import BlockOutOfRange, CorruptFrame, OutputMismatch
from ..format import DEFAULT_CHUNK, HEADER_SIZE, FrameCodec, Header, Stream, make_header, parse_header, stored_size
from ..launch import in_context, kernel_parameters, zero_async
from ..staging import Pending, current_stream, optional_cupy, read_to_host, start_read

THREADS = 128
# Compile-time choices of splitzip_cuda.cu, measured on an H200 (`bench/codec_gpu.py --sweep`):
# lanes of a warp that share one chunk, the register cap (min blocks per SM), cache hints, and
# whether bfloat16 lanes take two adjacent groups per encode step; whether the dense passes run
# as many blocks as fit at once, each looping over chunks (CHUNKS_PER_WARP 0), or enough blocks
# for that many chunks per warp, queued as the GPU frees room; the lean kernels' register caps.
TUNING = {"LANES": 32, "MINB": 8, "LOAD_HINT": 0, "STORE_HINT": 0, "ENC_WIDE": 1, "CHUNKS_PER_WARP": 2,
          "ENC_LEAN_MINB": 8, "DEC_LEAN_MINB": 8, "VALIDATE_THREADS": 1024}
# Threads per block of encode's tile kernels (SCAN_THREADS in the kernels: a chunk per thread),
# and chunks per thread of decode's validation scan (SCAN_ITEMS: a tile is VALIDATE_THREADS
# times that).
SCAN_THREADS, SCAN_ITEMS = 1024, 4
# Elements per pass of a subgroup (SPAN): encode_lean takes chunks of whole passes.
LEAN_SPAN = 1024
# Encode's scratch holds 1/SPILL_FRACTION of a chunk's elements as escapes; the tail finds the
# escapes of a chunk with more in the source again (rare: such data is mostly stored).
SPILL_FRACTION = 8
_SOURCE = Path(__file__).with_name("splitzip_cuda.cu")
_FLAG_REASONS = {
    1: "a chunk's escape count exceeds the chunk's size",
    2: "chunk escape counts overrun the escape total",
    4: "an escape position lies outside its chunk",
    8: "escape positions within a chunk are not strictly increasing",
    16: "an escape exponent does not fit the exponent field",
    32: "chunk escape counts do not sum to the header's total",
}
_BAD_ID, _REPEATED_ID = 64, 128  # block ids, checked by the same kernel


@functools.cache
def available() -> bool:
    """True when CUDA and CuPy are both usable (asked once: neither changes in a process)."""
    return optional_cupy() is not None and torch.cuda.is_available()


def supports(chunk: int) -> bool:
    """The kernels need whole 8-element groups per chunk and escape counts below 2**15; other
    chunk sizes take the torch path."""
    return chunk % 8 == 0 and chunk < 1 << 15


def _template(layout: FloatLayout) -> str:
    return f"<{layout.total_bits},{layout.exp_bits},{layout.code_bits}>"


@functools.cache
def _module(device_index: int, tuning: tuple[tuple[str, int], ...]):
    cupy = optional_cupy()
    names = set()
    for layout in LAYOUTS:
        names |= {f"encode_dense{_template(layout)}", f"decode_chunks{_template(layout)}",
                  f"encode_lean{_template(layout)}", f"decode_lean{_template(layout)}",
                  f"validate_escapes<{layout.exp_bits}>", f"encode_tail<{layout.total_bits}>"}
    names |= {"decode_header", "sum_tiles"}
    options = ("-std=c++17", *(f"-D{key}={value}" for key, value in tuning))
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=options, name_expressions=sorted(names))
        module.compile()
    return module


@dataclass(frozen=True)
class _Kernel:
    """A compiled kernel and the most blocks that fit on the GPU at once (``resident_blocks``).
    Every kernel loops over its work, so any grid covers it: a launch is capped there unless it
    asks for every block (the dense passes, whose queued blocks balance the SMs' finish times,
    and the scans, which take tiles by ticket).

    Launches go straight to ``cuLaunchKernel`` with the arguments written into a parameter block
    kept per thread (``kernel_parameters``): every argument is passed as 8 little-endian bytes (a
    32-bit parameter reads the low half). That costs well under a microsecond where CuPy's
    per-argument conversion cost tens, on every call.
    """

    name: str
    function: int  # CUfunction
    threads: int  # per block
    resident_blocks: int
    device_index: int
    owner: object  # CuPy's RawKernel, which keeps the module (and so the function) loaded

    def __call__(self, stream: int, grid: int, args: tuple[int, ...], *, every_block: bool = False) -> None:
        """Launch ``grid`` blocks, capped at ``resident_blocks`` unless ``every_block``."""
        blocks = max(1, grid if every_block else min(grid, self.resident_blocks))
        in_context(self.device_index, optional_cupy().cuda.driver.launchKernel,
                    self.function, blocks, 1, 1, self.threads, 1, 1, 0, stream, kernel_parameters(args), 0)


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, name: str, tuning: tuple[tuple[str, int], ...], threads: int = THREADS) -> _Kernel:
    cupy = optional_cupy()
    function = _module(device_index, tuning).get_function(name)
    with cupy.cuda.Device(device_index):
        handle = function.kernel.ptr  # the CUfunction under CuPy's RawKernel
    regs = (max(1, function.num_regs) + 7) // 8 * 8
    per_sm = max(1, min(2048 // threads, 65536 // (regs * threads)))
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _Kernel(name, handle, threads, per_sm * sms, device_index, function)


def _blocks_for_chunks(chunks: int, tuning: tuple[tuple[str, int], ...]) -> int:
    """Blocks for a dense pass over ``chunks``: one chunk per subgroup, capped at what fits on the
    GPU when the kernels persist (``_Kernel``), else CHUNKS_PER_WARP chunks per subgroup."""
    knobs = dict(tuning)
    per_subgroup = knobs["CHUNKS_PER_WARP"] or 1
    return max(1, -(-chunks * knobs["LANES"] // (THREADS * per_subgroup)))


def _on_device(data: bytes, device: torch.device) -> torch.Tensor:
    """Small host bytes to the device through pinned memory, without waiting for the device."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory().to(device, non_blocking=True)


def _tuning() -> tuple[tuple[str, int], ...]:
    return tuple(sorted(TUNING.items()))


@dataclass(frozen=True)
class _EncodePlan:
    """Everything about encoding one (layout, shape, chunk, codebook) that does not depend on
    the data: stream offsets, tables on the device, kernels and grids, scalar arguments."""

    numel: int
    nchunks: int
    capacity: int
    dense: _Kernel
    lean: _Kernel  # the dense pass for whole chunks inside blocks, aligned (the common case)
    dense_grid: int
    lean_grid: int  # for the whole chunks
    dense_uncapped: bool  # CHUNKS_PER_WARP > 0: launch every block of the grid
    tiles: int  # of SCAN_THREADS chunks: the tail's blocks
    sums: _Kernel
    tail: _Kernel
    residual_off: int
    codes_off: int
    counts_off: int
    marked_table: torch.Tensor
    exp_bits: int
    escape_mark: int  # marked_table's value for an exponent outside the codebook
    templates: torch.Tensor
    dense_scalars: tuple
    tail_scalars: tuple


@functools.lru_cache(maxsize=256)
def _encode_plan(layout: FloatLayout, shape: tuple[int, ...], chunk: int, codebook: tuple[int, ...],
                 device: torch.device, tuning: tuple[tuple[str, int], ...]) -> _EncodePlan:
    numel = 1
    for dim in shape:
        numel *= dim
    nchunks = (numel + chunk - 1) // chunk
    dense = make_header(FrameCodec.SPLITZIP, layout, shape, chunk, codebook, 0)
    stored = make_header(FrameCodec.STORED, layout, shape, 0, (), 0)
    off, lengths = dense.offsets, dense.lengths
    counts_end = off[Stream.CHUNK_COUNTS] + lengths[Stream.CHUNK_COUNTS]
    gaps = []  # where zero padding starts before the codes and the counts streams (0 = none)
    for stream in (Stream.CODES, Stream.CHUNK_COUNTS):
        previous_end = off[stream - 1] + lengths[stream - 1]
        gaps.append(previous_end if lengths[stream] and off[stream] > previous_end else 0)
    marked = bytearray([layout.codebook_size] * (1 << layout.exp_bits))
    for code, exponent in enumerate(codebook):
        marked[exponent] = code
    return _EncodePlan(
        numel=numel, nchunks=nchunks, capacity=max(stored.total, dense.total),
        dense=_kernel(device.index, f"encode_dense{_template(layout)}", tuning),
        lean=_kernel(device.index, f"encode_lean{_template(layout)}", tuning),
        dense_grid=_blocks_for_chunks(nchunks, tuning),
        lean_grid=_blocks_for_chunks(numel // chunk, tuning),
        dense_uncapped=dict(tuning)["CHUNKS_PER_WARP"] > 0,
        tiles=-(-nchunks // SCAN_THREADS),
        sums=_kernel(device.index, "sum_tiles", tuning, SCAN_THREADS),
        tail=_kernel(device.index, f"encode_tail<{layout.total_bits}>", tuning, SCAN_THREADS),
        residual_off=off[Stream.RESIDUAL], codes_off=off[Stream.CODES], counts_off=off[Stream.CHUNK_COUNTS],
        marked_table=_on_device(bytes(marked), device), exp_bits=layout.exp_bits, escape_mark=layout.codebook_size,
        templates=_on_device(dense.pack() + stored.pack() + _crc_deltas(), device),
        dense_scalars=(numel, chunk, nchunks),
        tail_scalars=(counts_end, off[Stream.ESC_POSITIONS], stored.total, gaps[0], gaps[1]),
    )


@functools.cache
def _crc_deltas() -> bytes:
    """For each bit i of the escape total X, how the header CRC32C changes when that bit is set
    in the three fields that hold X (104: X, 136: 2X, 144: X), 64 little-endian words: CRC32C is
    affine, so the tail kernel patches the template's CRC with their XOR instead of hashing."""
    zero = crc32c(bytes(156))
    deltas = []
    for i in range(64):
        body = bytearray(156)
        body[104:112] = body[144:152] = (1 << i).to_bytes(8, "little")
        body[136:144] = ((2 << i) & (1 << 64) - 1).to_bytes(8, "little")
        deltas.append(crc32c(bytes(body)) ^ zero)
    return b"".join(d.to_bytes(4, "little") for d in deltas)


def capacity(layout: FloatLayout, shape: tuple[int, ...], chunk: int) -> int:
    """Bytes a buffer needs to receive the frame of a tensor of this layout and shape."""
    numel = 1
    for dim in shape:
        numel *= dim
    dense = make_header(FrameCodec.SPLITZIP, layout, shape, chunk, tuple(range(layout.codebook_size)), 0)
    return max(stored_size(layout, numel), dense.total)


def encode_into(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
                layout: FloatLayout, codebook: tuple[int, ...], chunk: int, buf: torch.Tensor) -> torch.Tensor:
    """Write the frame of ``source`` (flat contiguous) or ``source[block_ids]`` (a contiguous
    cache) into ``buf`` (at least ``capacity`` bytes) without any host synchronization.

    Returns the frame's length as a 0-d int64 tensor on the device: -1 if a block id lies outside
    the cache (checked on the device, before any block is read; nothing is written then).
    """
    plan = _encode_plan(layout, shape, chunk, codebook, source.device, _tuning())
    length = torch.empty((), dtype=torch.int64, device=source.device)  # the caller may hold it: not in scratch
    _encode_launch(plan, source, block_ids, block_elems, chunk, buf.data_ptr(), length.data_ptr(),
                   current_stream(source.device))
    return length


def _encode_launch(plan: _EncodePlan, source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int,
                   chunk: int, base: int, length_at: int, stream: int) -> None:
    """``encode_into``'s work, the frame written at ``base`` and its length at ``length_at``: the
    dense pass (the lean kernel, the general one, or the lean one then the general one for a
    partial last chunk), the per-tile sums and the tail pass. Nothing before the dense pass:
    the GPU starts as early as the host can launch it."""
    device = source.device
    # One int64 scratch: the escape count of each tile of SCAN_THREADS chunks, of each chunk, then
    # up to SPILL_FRACTION of each chunk's escapes spilled before compaction (3 bytes each).
    # Allocated per call, which the caching allocator makes cheap, so that encodes on different
    # streams never share scratch.
    tiles, nchunks = plan.tiles, plan.nchunks
    cap = chunk // SPILL_FRACTION
    scratch = torch.empty(tiles + nchunks + -(-3 * nchunks * cap // 8), dtype=torch.int64, device=device)
    tile_sums = scratch.data_ptr()
    counts, spill_pos = tile_sums + 8 * tiles, tile_sums + 8 * (tiles + nchunks)
    spill_val = spill_pos + nchunks * cap * 2
    ids = 0 if block_ids is None else block_ids.data_ptr()
    nblocks = source.numel() // block_elems if block_elems else 0
    source_at, whole = source.data_ptr(), plan.numel // chunk
    streams = (plan.marked_table.data_ptr(), base + plan.residual_off, base + plan.codes_off, base + plan.counts_off,
               counts, spill_pos, spill_val, cap)
    first = 0  # the general kernel's first chunk
    if chunk % LEAN_SPAN == 0 and source_at % 16 == 0 and (block_ids is None or block_elems % chunk == 0) and whole:
        plan.lean(stream, plan.lean_grid, (
            source_at, ids, block_elems, nblocks, plan.numel, chunk, whole, *streams,
        ), every_block=plan.dense_uncapped)
        first = whole
    if first < nchunks:  # every chunk, or the partial last one
        plan.dense(stream, plan.dense_grid if first == 0 else 1,
                   (source_at, ids, block_elems, nblocks, *plan.dense_scalars, first, *streams),
                   every_block=plan.dense_uncapped)
    plan.sums(stream, tiles, (counts, nchunks, tile_sums), every_block=True)
    plan.tail(stream, tiles, (
        counts, tile_sums, tiles, nchunks, chunk, spill_pos, spill_val, cap, plan.marked_table.data_ptr(),
        plan.exp_bits, plan.escape_mark, source.data_ptr(), ids, block_elems, plan.numel, base, *plan.tail_scalars,
        plan.templates.data_ptr(), length_at,
    ), every_block=True)


def encode(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
           layout: FloatLayout, codebook: tuple[int, ...], chunk: int, checksum: bool) -> torch.Tensor:
    """Frame for ``source`` (flat contiguous), or for ``source[block_ids]`` (a contiguous cache).
    One host synchronization, at the end, to learn the frame's length.

    Raises:
        BlockOutOfRange: a block id outside the cache.
    """
    buf, length_offset = _encode_buffered(source, block_ids, block_elems, shape, layout, codebook, chunk)
    stream = current_stream(source.device)
    frame = _framed(buf, int(read_to_host(buf, 8, stream, offset=length_offset).view(np.int64)[0]), source, block_elems)
    if checksum:
        header = parse_header(frame[:HEADER_SIZE].cpu().numpy().tobytes(), frame.numel())
        header = replace(header, stream_crc=crc32c(frame[HEADER_SIZE:].cpu().numpy().data))
        frame[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    return frame


def start_encode(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
                 layout: FloatLayout, codebook: tuple[int, ...], chunk: int) -> Pending[torch.Tensor]:
    """``encode`` (without a stream checksum) launched on torch's current stream: the frame
    once it has run, read without blocking the caller meanwhile.

    Raises (from ``result``):
        BlockOutOfRange: a block id outside the cache.
    """
    buf, length_offset = _encode_buffered(source, block_ids, block_elems, shape, layout, codebook, chunk)
    return start_read(buf, 8, length_offset).then(
        lambda length: _framed(buf, int(length.view(np.int64)[0]), source, block_elems))


def _encode_buffered(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
                     layout: FloatLayout, codebook: tuple[int, ...], chunk: int) -> tuple[torch.Tensor, int]:
    """Launch an encode into a new buffer: (the buffer, the offset of the frame's length in it)."""
    device = source.device
    plan = _encode_plan(layout, shape, chunk, codebook, device, _tuning())
    # The frame's buffer, with 8 aligned bytes after it for the length: one allocation fewer.
    length_offset = (plan.capacity + 7) // 8 * 8
    buf = torch.empty(length_offset + 8, dtype=torch.uint8, device=device)
    _encode_launch(plan, source, block_ids, block_elems, chunk, buf.data_ptr(), buf.data_ptr() + length_offset,
                   current_stream(device))
    return buf, length_offset


def _framed(buf: torch.Tensor, length: int, source: torch.Tensor, block_elems: int) -> torch.Tensor:
    if length < 0:
        raise BlockOutOfRange(f"block ids must be in 0..{source.numel() // block_elems - 1}")
    return buf[:length]


# Decode's scratch holds escape offsets for this many chunks of the element count: frames with
# shorter chunks take the host-parsed path, which sizes the scratch from their header.
MIN_UNPARSED_CHUNK = 256
_PARAM_WORDS = 10  # decode_header's findings (PARAM_WORDS in the kernels)
_FLAG_HOST = 512
_ZEROED_BY_HEADER = 16 << 10  # bytes of decode scratch that decode_header zeroes itself


@dataclass(frozen=True)
class _DecodePlan:
    """Kernels and grids for decoding frames of one (layout, element count, scratch size)."""

    header: _Kernel
    validate: _Kernel
    dense: _Kernel
    lean: _Kernel  # the dense pass into aligned memory, chunks inside blocks (the common case)
    validate_grid: int  # sized for the default chunk; blocks draw more tiles if a frame has more
    dense_grid: int
    dense_uncapped: bool  # CHUNKS_PER_WARP > 0: launch every block of dense_grid
    tiles: int  # look-back status words for max_nchunks


@functools.lru_cache(maxsize=64)
def _decode_plan(layout: FloatLayout, numel: int, max_nchunks: int, device: torch.device,
                 tuning: tuple[tuple[str, int], ...]) -> _DecodePlan:
    usual = -(-numel // DEFAULT_CHUNK)
    validate_threads = dict(tuning)["VALIDATE_THREADS"]
    tile = validate_threads * SCAN_ITEMS
    return _DecodePlan(
        header=_kernel(device.index, "decode_header", tuning, 32),
        validate=_kernel(device.index, f"validate_escapes<{layout.exp_bits}>", tuning, validate_threads),
        dense=_kernel(device.index, f"decode_chunks{_template(layout)}", tuning),
        lean=_kernel(device.index, f"decode_lean{_template(layout)}", tuning),
        validate_grid=max(1, -(-usual // tile)), dense_grid=_blocks_for_chunks(usual, tuning),
        dense_uncapped=dict(tuning)["CHUNKS_PER_WARP"] > 0, tiles=-(-max_nchunks // tile),
    )


def decode_unparsed(frame: torch.Tensor, out: torch.Tensor, layout: FloatLayout, *,
                    shape: tuple[int, ...] | None = None, block_ids: torch.Tensor | None = None,
                    block_elems: int = 0, max_nchunks: int | None = None, stream_crc_verified: bool = False,
                    chunks_in_blocks: bool = True) -> bool:
    """Decode ``frame`` (16-byte aligned) into ``out`` (contiguous), or into the blocks
    ``block_ids`` of the cache ``out``, with the header checked on the device: the GPU starts
    without waiting for the host to read it. ``shape``, when given, is the shape the frame must
    declare. With ``chunks_in_blocks`` (the default: the lean kernel's condition) frames whose
    chunks cross the cache's blocks are declined; the host-parsed path passes False for them.

    Returns False, with nothing written, for a frame this path does not take (a bad or mismatched
    header, a stream checksum not yet verified, short chunks, chunks across blocks): the caller
    then parses the header on the host, which raises the precise error or decodes the frame
    another way.

    Raises:
        CorruptFrame: the escape streams fail validation. BlockOutOfRange: a block id outside the
            cache. OutputMismatch: a block id repeats. In every case nothing was written.
    """
    scratch, nblocks = _decode_launch(frame, out, layout, shape, block_ids, block_elems, max_nchunks,
                                      stream_crc_verified, chunks_in_blocks)
    # The kernels after decode_header wrote nothing if anything failed; one sync, at the end.
    return _verdict(int(read_to_host(scratch, 4, current_stream(frame.device)).view(np.int32)[0]), nblocks)


def start_decode_unparsed(frame: torch.Tensor, out: torch.Tensor, layout: FloatLayout, *,
                          shape: tuple[int, ...] | None = None, block_ids: torch.Tensor | None = None,
                          block_elems: int = 0) -> Pending[bool]:
    """``decode_unparsed`` launched on torch's current stream: its answer once that has run,
    read without blocking the caller meanwhile (raising as ``decode_unparsed`` does)."""
    scratch, nblocks = _decode_launch(frame, out, layout, shape, block_ids, block_elems, None, False, True)
    return start_read(scratch, 4).then(lambda verdict: _verdict(int(verdict.view(np.int32)[0]), nblocks))


def _decode_launch(frame: torch.Tensor, out: torch.Tensor, layout: FloatLayout, shape: tuple[int, ...] | None,
                   block_ids: torch.Tensor | None, block_elems: int, max_nchunks: int | None,
                   stream_crc_verified: bool, chunks_in_blocks: bool) -> tuple[torch.Tensor, int]:
    """Launch ``decode_unparsed``'s kernels: (the scratch whose first word is the verdict, the
    cache's block count)."""
    device = frame.device
    nids = 0 if block_ids is None else block_ids.numel()
    numel = nids * block_elems if block_ids is not None else out.numel()
    if max_nchunks is None:
        max_nchunks = -(-numel // MIN_UNPARSED_CHUNK)
    plan = _decode_plan(layout, numel, max_nchunks, device, _tuning())
    stream = current_stream(device)
    lean = chunks_in_blocks and out.data_ptr() % 16 == 0
    ids = block_ids.data_ptr() if nids else 0
    nblocks = out.numel() // block_elems if nids else 0
    # One scratch: the verdict word and the scan's ticket, a look-back status word per tile, a
    # bitmap of the cache's blocks for spotting repeated ids (all zeroed), then decode_header's
    # findings and the escape offsets.
    bitmap = 8 * (1 + plan.tiles)
    zeroed = bitmap + 8 * ((nblocks + 63) // 64)
    scratch = torch.empty(zeroed + 8 * (_PARAM_WORDS + max_nchunks), dtype=torch.uint8, device=device)
    words = scratch.data_ptr()
    in_kernel = zeroed <= _ZEROED_BY_HEADER  # else a memset: one warp would take long
    if not in_kernel:
        zero_async(device.index, words, zeroed, stream)
    flags, params, base = words, words + zeroed, frame.data_ptr()
    inclusive = params + 8 * _PARAM_WORDS
    expected = (255,) + (0,) * 8 if shape is None else (len(shape), *shape, *(0,) * (8 - len(shape)))
    plan.header(stream, 1, (
        base, frame.numel(), layout.wire_id, layout.exp_bits, layout.code_bits, layout.residual_bits, layout.itemsize,
        numel,
        *expected, max_nchunks, block_elems if lean and nids else 0, int(stream_crc_verified), params, flags,
        words, zeroed // 8 if in_kernel else 0,
    ))
    plan.validate(stream, max(plan.validate_grid, -(-nids // plan.validate.threads)), (
        base, params, inclusive, numel, ids, nids, nblocks, words + bitmap, flags, words + 8, words + 4,
    ), every_block=True)
    (plan.lean if lean else plan.dense)(stream, plan.dense_grid, (
        base, params, inclusive, numel, out.data_ptr(), ids, block_elems, flags,
    ), every_block=plan.dense_uncapped)
    return scratch, nblocks


def _verdict(verdict: int, nblocks: int) -> bool:
    """``decode_unparsed``'s answer from its verdict word."""
    if verdict & _FLAG_HOST:
        return False
    if verdict & _BAD_ID:
        raise BlockOutOfRange(f"block ids must be in 0..{nblocks - 1}")
    if verdict & _REPEATED_ID:
        raise OutputMismatch("block ids repeat")
    if verdict:
        raise CorruptFrame("; ".join(text for bit, text in _FLAG_REASONS.items() if verdict & bit))
    return True


def decode_into(frame: torch.Tensor, header: Header, out: torch.Tensor,
                block_ids: torch.Tensor | None = None, block_elems: int = 0) -> None:
    """Decode a frame whose header the host has parsed (and whose stream checksum, if any, it
    has verified) into ``out`` (contiguous, any shape; for a coded frame also a cache with
    ``block_ids``, which are checked on the device with the escape streams).

    Raises:
        CorruptFrame, BlockOutOfRange, OutputMismatch: as ``decode_unparsed``; nothing was written.
    """
    if header.codec == FrameCodec.STORED:
        out.view(-1).copy_(frame[HEADER_SIZE:header.total].view(header.layout.dtype))
        return
    nchunks = -(-header.numel // header.chunk)
    if not decode_unparsed(frame, out, header.layout, block_ids=block_ids, block_elems=block_elems,
                           max_nchunks=nchunks, stream_crc_verified=header.stream_crc is not None,
                           chunks_in_blocks=block_ids is None or block_elems % header.chunk == 0):
        raise CorruptFrame("the device's header check rejected a header the host accepted")


def check_alignment(frame: torch.Tensor) -> torch.Tensor:
    """Kernels read streams with aligned vector loads: realign a frame that sits oddly in memory."""
    return frame if frame.data_ptr() % 16 == 0 else frame.clone()
