"""SplitZip on CUDA: launchers for the kernels in ``splitzip_cuda.cu`` (CuPy/NVRTC, compiled on
first use and cached). Produces frames byte-identical to the torch reference in ``splitzip.py``.

Encode: one dense pass (residual + codes + per-chunk escape counts, escapes spilled per chunk),
a scan over chunk counts, one sparse pass compacting escapes. Its only host synchronization reads
the escape total, which fixes the frame's size. Decode: one small validation pass over the
escape streams (one synchronization to read its verdict), then one pass that looks up every
element and overwrites the escapes of each chunk. Everything runs on torch's current stream.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import torch

from .checksum import crc32c
from .dtypes import FloatLayout
from .errors import CorruptFrame
from .format import HEADER_SIZE, Codec, Header, Stream, make_header, parse_header, stored_size

THREADS = 128
# Lanes of a warp that share one chunk (32, 16 or 8), and the register cap (min blocks per SM):
# compile-time choices of splitzip_cuda.cu, measured in bench/RESULTS.md.
TUNING = {"LANES": 32, "MINB": 8}
_SOURCE = Path(__file__).with_name("splitzip_cuda.cu")
_FLAG_REASONS = {
    1: "a chunk's escape count exceeds the chunk's size",
    2: "chunk escape counts overrun the escape total",
    4: "an escape position lies outside its chunk",
    8: "escape positions within a chunk are not strictly increasing",
    16: "an escape exponent does not fit the exponent field",
    32: "chunk escape counts do not sum to the header's total",
}


def available() -> bool:
    """True when CUDA and CuPy are both usable."""
    return _cupy() is not None and torch.cuda.is_available()


def supports(chunk: int) -> bool:
    """The kernels need whole 8-element groups per chunk and escape counts below 2**15; other
    chunk sizes take the torch path."""
    return chunk % 8 == 0 and chunk < 1 << 15


@functools.cache
def _cupy():
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy that finds no CUDA runtime
        return None
    return cupy


def _template(layout: FloatLayout) -> str:
    return f"<{layout.total_bits},{layout.exp_bits},{layout.code_bits}>"


@functools.cache
def _module(device_index: int, tuning: tuple[tuple[str, int], ...]):
    cupy = _cupy()
    names = []
    for template in {_template(layout) for layout in _layouts()}:
        names.append(f"encode_dense{template}")
        names.append(f"decode_chunks{template}")
    for exp_bits in {layout.exp_bits for layout in _layouts()}:
        names.append(f"validate_escapes<{exp_bits}>")
    for total_bits in {layout.total_bits for layout in _layouts()}:
        names.append(f"copy_stored<{total_bits}>")
    options = ("-std=c++17", *(f"-D{key}={value}" for key, value in tuning))
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=options, name_expressions=names)
        module.compile()
    return module


def _layouts():
    from .dtypes import LAYOUTS

    return LAYOUTS


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, name: str, tuning: tuple[tuple[str, int], ...]):
    """(function, blocks resident at once): every kernel loops over its chunks, so a grid larger
    than what fits on the GPU would only queue."""
    function = _module(device_index, tuning).get_function(name)
    regs = max(1, function.num_regs)
    per_sm = max(1, min(2048 // THREADS, 65536 // (((regs + 7) // 8 * 8) * THREADS)))
    return function, per_sm * torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(device: torch.device, name: str, items: int, args: tuple, threads: int = THREADS) -> None:
    """Launch ``name`` over ``items`` work items (chunks, or warps' worth of groups) on torch's
    current stream. The dense kernels give a chunk to each LANES-lane subgroup, the rest an item
    to each warp."""
    if items == 0:
        return
    tuning = tuple(sorted(TUNING.items()))
    function, resident = _kernel(device.index, name, tuning)
    lanes = TUNING["LANES"] if name.startswith(("encode_dense", "decode_chunks")) else 32
    grid = max(1, min(-(-items * lanes // threads), resident))
    with _cupy().cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index):
        function((grid,), (threads,), args)


@functools.lru_cache(maxsize=32)
def _cupy_stream(pointer: int, device_index: int):
    """CuPy's view of a torch stream, made once per stream."""
    cupy = _cupy()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the replacement needs a stream object
        return cupy.cuda.ExternalStream(pointer, device_index)


def _ptr(t: torch.Tensor | None):
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def _u64(v: int):
    import numpy as np

    return np.uint64(v)


def _u32(v: int):
    import numpy as np

    return np.uint32(v)


def _on_device(data: bytes, device: torch.device) -> torch.Tensor:
    """Small host bytes to the device through pinned memory, without waiting for the device."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _marked_table(codebook: tuple[int, ...], exp_bits: int, size: int, device: torch.device) -> torch.Tensor:
    """Code of each exponent value, or ``size`` for an escape (one lookup gives both)."""
    table = bytearray([size] * (1 << exp_bits))
    for code, exponent in enumerate(codebook):
        table[exponent] = code
    return _on_device(bytes(table), device)


@functools.lru_cache(maxsize=64)
def _codebook_table(codebook: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return _on_device(bytes(codebook), device)


@functools.lru_cache(maxsize=256)
def _header_templates(layout: FloatLayout, shape: tuple[int, ...], chunk: int, codebook: tuple[int, ...],
                      device: torch.device) -> torch.Tensor:
    """The coded header with no escapes and the stored header, side by side on the device:
    the finishing kernel picks one and patches the escape fields. Cached: KV chunks repeat shapes."""
    coded = make_header(Codec.SPLITZIP, layout, shape, chunk, codebook, 0).pack()
    stored = make_header(Codec.STORED, layout, shape, 0, (), 0).pack()
    return _on_device(coded + stored, device)


def capacity(layout: FloatLayout, shape: tuple[int, ...], chunk: int) -> int:
    """Bytes a buffer needs to receive the frame of a tensor of this layout and shape."""
    numel = 1
    for dim in shape:
        numel *= dim
    dense = make_header(Codec.SPLITZIP, layout, shape, chunk, tuple(range(layout.codebook_size)), 0)
    return max(stored_size(layout, numel), dense.total)


def encode_into(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
                layout: FloatLayout, codebook: tuple[int, ...], chunk: int, buf: torch.Tensor) -> torch.Tensor:
    """Write the frame of ``source`` (flat contiguous) or ``source[block_ids]`` (a contiguous
    cache) into ``buf`` (at least ``capacity`` bytes) without any host synchronization.

    Returns the frame's length as a 0-d int64 tensor on the device.
    """
    device = source.device
    numel = 1
    for dim in shape:
        numel *= dim
    nchunks = (numel + chunk - 1) // chunk
    dense = make_header(Codec.SPLITZIP, layout, shape, chunk, codebook, 0)
    raw_total = stored_size(layout, numel)
    counts32 = torch.empty(nchunks, dtype=torch.int32, device=device)
    # Escapes spill per chunk before compaction. Per call (the caching allocator makes that
    # cheap) so that encodes on different streams never share scratch.
    spill_pos = torch.empty(nchunks * chunk, dtype=torch.int16, device=device)
    spill_val = torch.empty(nchunks * chunk, dtype=torch.uint8, device=device)
    length = torch.empty((), dtype=torch.int64, device=device)
    off = dense.offsets
    counts_end = off[Stream.CHUNK_COUNTS] + dense.lengths[Stream.CHUNK_COUNTS]
    _launch(device, f"encode_dense{_template(layout)}", nchunks, (
        _ptr(source), _ptr(block_ids), _u64(block_elems), _u64(numel), _u32(chunk),
        _u64(nchunks), _ptr(_marked_table(codebook, layout.exp_bits, layout.codebook_size, device)),
        _ptr(buf) + _u64(off[Stream.RESIDUAL]), _ptr(buf) + _u64(off[Stream.CODES]),
        _ptr(buf) + _u64(off[Stream.CHUNK_COUNTS]), _ptr(counts32), _ptr(spill_pos), _ptr(spill_val),
    ))
    inclusive = torch.cumsum(counts32, 0, dtype=torch.int64)
    tail = (_ptr(inclusive), _u64(nchunks), _u64(counts_end), _u64(off[Stream.ESC_POSITIONS]), _u64(raw_total))
    _launch(device, "gather_escapes", nchunks, (
        _ptr(counts32), _ptr(inclusive), _u64(nchunks), _u32(chunk), _ptr(spill_pos), _ptr(spill_val),
        _ptr(buf), _u64(counts_end), _u64(off[Stream.ESC_POSITIONS]), _u64(raw_total), *_padding_gaps(dense),
    ))
    _launch(device, f"copy_stored<{layout.total_bits}>", -(-numel // (8 * 32)), (
        _ptr(source), _ptr(block_ids), _u64(block_elems), _u64(numel), *tail, _ptr(buf),
    ))
    _launch(device, "finish_frame", 1, (
        _ptr(buf), _ptr(_header_templates(layout, shape, chunk, codebook, device)), *tail, _ptr(length),
    ), threads=256)
    return length


def encode(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
           layout: FloatLayout, codebook: tuple[int, ...], chunk: int, checksum: bool) -> torch.Tensor:
    """Frame for ``source`` (flat contiguous), or for ``source[block_ids]`` (a contiguous cache).
    One host synchronization, at the end, to learn the frame's length."""
    buf = torch.empty(capacity(layout, shape, chunk), dtype=torch.uint8, device=source.device)
    length = int(encode_into(source, block_ids, block_elems, shape, layout, codebook, chunk, buf))
    frame = buf[:length]
    if checksum:
        header = parse_header(frame[:HEADER_SIZE].cpu().numpy().tobytes(), length)
        header = replace(header, stream_crc=crc32c(frame[HEADER_SIZE:].cpu().numpy().data))
        frame[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    return frame


def _padding_gaps(dense: Header) -> list:
    """Where the zero padding before the codes and the counts streams starts (0 = none); the
    compaction kernel writes it, and the padding before the escape streams, saving launches."""
    gaps = []
    for stream in (Stream.CODES, Stream.CHUNK_COUNTS):
        previous_end = dense.offsets[stream - 1] + dense.lengths[stream - 1]
        needed = dense.lengths[stream] and dense.offsets[stream] > previous_end
        gaps.append(_u64(previous_end if needed else 0))
    return gaps


def decode_into(frame: torch.Tensor, header: Header, out: torch.Tensor,
                block_ids: torch.Tensor | None = None, block_elems: int = 0) -> None:
    """Decode a validated-header frame into ``out`` (flat contiguous, or a cache with block_ids).

    Raises:
        CorruptFrame: the escape streams fail validation (checked before any write).
    """
    device = frame.device
    layout = header.layout
    if header.codec == Codec.STORED:
        raw = frame[HEADER_SIZE:header.total].view(layout.dtype)
        if block_ids is None:
            out.copy_(raw)
        else:
            bits = layout.int_dtype  # index_copy_ lacks float8 kernels
            out.view(bits).view(-1, block_elems).index_copy_(0, block_ids, raw.view(bits).view(-1, block_elems))
        return
    numel, chunk = header.numel, header.chunk
    nchunks = (numel + chunk - 1) // chunk
    off = header.offsets
    # Counts are < 2**15 for the chunk sizes this path takes (``supports``); a corrupt count with
    # the top bit set reads negative here, but validation reads it unsigned and rejects it.
    counts = frame[off[Stream.CHUNK_COUNTS]:off[Stream.CHUNK_COUNTS] + 2 * nchunks].view(torch.int16)
    inclusive = torch.cumsum(counts, 0, dtype=torch.int64)
    flags = torch.zeros(1, dtype=torch.int32, device=device)
    _launch(device, f"validate_escapes<{layout.exp_bits}>", nchunks, (
        _ptr(frame) + _u64(off[Stream.CHUNK_COUNTS]), _ptr(inclusive), _u64(nchunks), _u64(numel),
        _u32(chunk), _u64(header.escapes), _ptr(frame) + _u64(off[Stream.ESC_POSITIONS]),
        _ptr(frame) + _u64(off[Stream.ESC_VALUES]), _ptr(flags),
    ))
    _launch(device, f"decode_chunks{_template(layout)}", nchunks, (
        _ptr(frame) + _u64(off[Stream.RESIDUAL]), _ptr(frame) + _u64(off[Stream.CODES]),
        _ptr(frame) + _u64(off[Stream.CHUNK_COUNTS]), _ptr(inclusive),
        _ptr(frame) + _u64(off[Stream.ESC_POSITIONS]), _ptr(frame) + _u64(off[Stream.ESC_VALUES]),
        _ptr(_codebook_table(header.codebook, device)), _u64(numel), _u32(chunk),
        _u64(nchunks), _ptr(out), _ptr(block_ids), _u64(block_elems), _ptr(flags),
    ))
    # The decode kernel skipped every write if validation failed; one sync, after all the work.
    verdict = int(flags.item())
    if verdict:
        reasons = "; ".join(text for bit, text in _FLAG_REASONS.items() if verdict & bit)
        raise CorruptFrame(reasons)


def check_alignment(frame: torch.Tensor) -> torch.Tensor:
    """Kernels read streams with aligned vector loads: realign a frame that sits oddly in memory."""
    return frame if frame.data_ptr() % 16 == 0 else frame.clone()

