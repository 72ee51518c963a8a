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
from .format import HEADER_SIZE, Codec, Header, Stream, make_header, stored_size

THREADS = 128
# Lanes of a warp that share one chunk (32, 16 or 8), and the register cap (min blocks per SM):
# compile-time choices of splitzip_cuda.cu, measured in bench/RESULTS.md.
TUNING = {"LANES": 16, "MINB": 1}
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
    """The kernels need whole 8-element groups per chunk; other chunk sizes use the torch path."""
    return chunk % 8 == 0


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


def _launch(device: torch.device, name: str, chunks: int, args: tuple) -> None:
    """Launch ``name`` over ``chunks`` chunks on torch's current stream. The dense kernels give
    a chunk to each LANES-lane subgroup, the sparse ones a chunk to each warp."""
    if chunks == 0:
        return
    tuning = tuple(sorted(TUNING.items()))
    function, resident = _kernel(device.index, name, tuning)
    lanes = TUNING["LANES"] if name.startswith(("encode_dense", "decode_chunks")) else 32
    grid = min(-(-chunks * lanes // THREADS), resident)
    with _cupy().cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index):
        function((grid,), (THREADS,), args)


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


@functools.lru_cache(maxsize=64)
def _marked_table(codebook: tuple[int, ...], exp_bits: int, size: int, device: torch.device) -> torch.Tensor:
    table = torch.full((1 << exp_bits,), size, dtype=torch.uint8)
    table[torch.tensor(codebook, dtype=torch.int64)] = torch.arange(size, dtype=torch.uint8)
    return table.to(device)


@functools.lru_cache(maxsize=64)
def _codebook_table(codebook: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(codebook, dtype=torch.uint8).to(device)


class _Spill:
    """Per-device scratch for escapes found by the dense pass, grown on demand and reused."""

    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def get(cls, device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos, val = cls.buffers.get(device.index, (None, None))
        if pos is None or pos.numel() < n:
            pos = torch.empty(n, dtype=torch.int16, device=device)
            val = torch.empty(n, dtype=torch.uint8, device=device)
            cls.buffers[device.index] = (pos, val)
        return pos, val


def encode(source: torch.Tensor, block_ids: torch.Tensor | None, block_elems: int, shape: tuple[int, ...],
           layout: FloatLayout, codebook: tuple[int, ...], chunk: int, checksum: bool) -> torch.Tensor:
    """Frame for ``source`` (flat contiguous), or for ``source[block_ids]`` (a contiguous cache)."""
    device = source.device
    numel = 1
    for dim in shape:
        numel *= dim
    nchunks = (numel + chunk - 1) // chunk
    dense = make_header(Codec.SPLITZIP, layout, shape, chunk, codebook, 0)
    raw_total = stored_size(layout, numel)
    buf = torch.empty(max(raw_total, dense.total), dtype=torch.uint8, device=device)
    counts32 = torch.empty(nchunks, dtype=torch.int32, device=device)
    spill_pos, spill_val = _Spill.get(device, nchunks * chunk)
    off = dense.offsets
    _launch(device, f"encode_dense{_template(layout)}", nchunks, (
        _ptr(source), _ptr(block_ids), _u64(block_elems), _u64(numel), _u32(chunk),
        _u64(nchunks), _ptr(_marked_table(codebook, layout.exp_bits, layout.codebook_size, device)),
        _ptr(buf) + _u64(off[Stream.RESIDUAL]), _ptr(buf) + _u64(off[Stream.CODES]),
        _ptr(buf) + _u64(off[Stream.CHUNK_COUNTS]), _ptr(counts32), _ptr(spill_pos), _ptr(spill_val),
    ))
    inclusive = torch.cumsum(counts32, 0, dtype=torch.int64)
    _launch(device, "gather_escapes", nchunks, (
        _ptr(counts32), _ptr(inclusive), _u64(nchunks), _u32(chunk), _ptr(spill_pos), _ptr(spill_val),
        _ptr(buf), _u64(off[Stream.CHUNK_COUNTS] + dense.lengths[Stream.CHUNK_COUNTS]),
        _u64(off[Stream.ESC_POSITIONS]), _u64(raw_total), *_padding_gaps(dense),
    ))
    escapes = int(inclusive[-1]) if nchunks else 0  # the one host sync: it fixes the frame size
    header = make_header(Codec.SPLITZIP, layout, shape, chunk, codebook, escapes)
    if header.total >= raw_total:
        header = make_header(Codec.STORED, layout, shape, 0, (), 0)
        raw = buf[HEADER_SIZE:raw_total].view(layout.dtype)
        if block_ids is None:
            raw.copy_(source.view(layout.dtype))
        else:
            bits = layout.int_dtype
            torch.index_select(source.view(bits).view(-1, block_elems), 0, block_ids,
                               out=raw.view(bits).view(-1, block_elems))
    frame = buf[: header.total]
    if checksum:
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
    counts = frame[off[Stream.CHUNK_COUNTS]:off[Stream.CHUNK_COUNTS] + 2 * nchunks].view(torch.int16)
    inclusive = torch.cumsum(counts.to(torch.int32) & 0xFFFF, 0, dtype=torch.int64)
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

