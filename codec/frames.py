"""``encode`` and ``decode``: whole self-describing frames, on the tensor's own device."""

from __future__ import annotations

import torch

from . import splitzip
from .checksum import crc32c
from .codebook import Codebook, calibrate
from .dtypes import FloatLayout, layout_for
from .errors import CodebookMismatch, CorruptFrame, OutputMismatch, UnsupportedTensor
from .fields import as_bits, from_bits, split
from .format import (DEFAULT_CHUNK, HEADER_SIZE, MAX_CHUNK, MAX_NDIM, Codec, Header, Stream,
                     make_header, parse_header, splitzip_size, stored_size)


def encode(x: torch.Tensor, codebook: Codebook | None = None, *, checksum: bool = False,
           chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Encode ``x`` into one frame: a 1-D uint8 tensor on ``x.device``.

    ``codebook=None`` calibrates on ``x`` itself. The frame is SplitZip-coded when that is smaller
    than storing the raw bytes, else stored; either way it never exceeds header + raw size.
    ``checksum=True`` adds a CRC32C of the streams, verified by ``decode``.

    Raises:
        UnsupportedTensor: dtype other than bf16/fp16/fp8 e5m2/fp8 e4m3fn, or rank above 8.
        CodebookMismatch: the codebook is for another dtype.
    """
    return _encode(x, codebook, checksum=checksum, chunk=chunk, force=None)


def _encode(x: torch.Tensor, codebook: Codebook | None, *, checksum: bool, chunk: int,
            force: Codec | None) -> torch.Tensor:
    """``encode`` with the codec choice overridable, so tests reach the escape path on data
    where storing would win."""
    layout = _check_tensor(x)
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in 1..{MAX_CHUNK}, got {chunk}")
    if codebook is None:
        codebook = calibrate(x)
    elif codebook.dtype != layout.name:
        raise CodebookMismatch(f"codebook is for {codebook.dtype}, tensor is {layout.name}")
    bits = as_bits(x, layout)
    exponent, residual = split(bits, layout)
    marked = splitzip.marked_codes(exponent, codebook.exponents, layout)
    escapes = splitzip.find_escapes(exponent, marked, chunk, layout)
    count = escapes.index.numel()
    shape = tuple(x.shape)
    smaller = splitzip_size(layout, x.numel(), chunk, count) < stored_size(layout, x.numel())
    if force == Codec.SPLITZIP or (force is None and smaller):
        header = make_header(Codec.SPLITZIP, layout, shape, chunk, codebook.exponents, count)
        streams = splitzip.encode_streams(residual, marked, escapes, layout)
    else:
        header = make_header(Codec.STORED, layout, shape, 0, (), 0)
        streams = [x.reshape(-1).view(torch.uint8)]
    frame = torch.zeros(header.total, dtype=torch.uint8, device=x.device)
    for offset, stream in zip(header.offsets, streams):
        frame[offset:offset + stream.numel()] = stream
    if checksum:
        header = _with_stream_crc(header, frame)
    frame[:HEADER_SIZE] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return frame


def decode(frame: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a frame into a new tensor of the original dtype and shape on ``frame.device``,
    or into ``out`` (same dtype and element count, any shape).

    Every field is validated before the first write, so a bad frame leaves ``out`` untouched.

    Raises:
        CorruptFrame: the frame is malformed, truncated, extended or fails a checksum.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    header = read_header(frame)
    if out is not None:
        if out.dtype != header.layout.dtype or out.numel() != header.numel:
            raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds "
                                 f"{header.layout.name}[{header.numel}]")
    if header.stream_crc is not None and _stream_crc(frame) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    streams = [frame[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    if header.codec == Codec.STORED:
        flat = streams[Stream.RESIDUAL].view(header.layout.dtype)
    else:
        flat = _decode_splitzip(header, streams)
    result = flat.view(header.shape)
    if out is None:
        return result.clone() if header.codec == Codec.STORED else result
    out.copy_(result.view(out.shape))
    return out


def read_header(frame: torch.Tensor) -> Header:
    """Validated header of a frame (reads only the header and the frame's size).

    Raises:
        CorruptFrame: not a 1-D uint8 tensor, or a header that fails validation.
    """
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise CorruptFrame("a frame is a 1-D torch.uint8 tensor")
    head = frame[:HEADER_SIZE].cpu().numpy().tobytes()
    return parse_header(head, frame.numel())


def _decode_splitzip(header: Header, streams: list[torch.Tensor]) -> torch.Tensor:
    layout = header.layout
    escapes = splitzip.read_escapes(streams[Stream.CHUNK_COUNTS], streams[Stream.ESC_POSITIONS],
                                    streams[Stream.ESC_VALUES], header.numel, header.chunk,
                                    header.escapes, layout)
    bits = splitzip.decode_bits(streams[Stream.RESIDUAL], streams[Stream.CODES], escapes,
                                header.codebook, header.numel, layout)
    return from_bits(bits, layout)


def _check_tensor(x: torch.Tensor) -> FloatLayout:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    layout = layout_for(x.dtype)
    if x.dim() > MAX_NDIM:
        raise UnsupportedTensor(f"rank {x.dim()} exceeds the format's maximum of {MAX_NDIM}")
    return layout


def _stream_crc(frame: torch.Tensor) -> int:
    return crc32c(frame[HEADER_SIZE:].cpu().numpy().data)


def _with_stream_crc(header: Header, frame: torch.Tensor) -> Header:
    from dataclasses import replace
    return replace(header, stream_crc=_stream_crc(frame))
