"""The frame's byte layout (format version 1): the one place that knows it. See FORMAT.md."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from . import prefix
from .checksum import crc32c
from .dtypes import FloatLayout, layout_by_wire_id
from .errors import CorruptFrame

VERSION = 1
MAX_NDIM = 8
DEFAULT_CHUNK = 1024
MAX_CHUNK = 65535  # escape positions and per-chunk counts are uint16
STREAM_ALIGN = 16
FLAG_STREAM_CRC = 0x01

# magic, version, codec, dtype, ndim, code_bits, flags, reserved, chunk, numel, shape[8],
# codebook[16], escapes, stream lengths[5], stream crc  -- then the header crc over all of that.
_BODY = prefix.Body("BBBBBIQ8Q16sQ5QI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 160


class FrameCodec(IntEnum):
    STORED = 0
    SPLITZIP = 1


class Stream(IntEnum):
    """Streams in frame order."""

    RESIDUAL = 0
    CODES = 1
    CHUNK_COUNTS = 2
    ESC_POSITIONS = 3
    ESC_VALUES = 4


def align(n: int) -> int:
    return (n + STREAM_ALIGN - 1) // STREAM_ALIGN * STREAM_ALIGN


def num_chunks(numel: int, chunk: int) -> int:
    return (numel + chunk - 1) // chunk


def stream_lengths(layout: FloatLayout, numel: int, chunk: int, escapes: int) -> tuple[int, ...]:
    """Byte length of each SplitZip stream; every one follows from four numbers."""
    return (
        (numel * layout.residual_bits + 7) // 8,
        (numel * layout.code_bits + 7) // 8,
        2 * num_chunks(numel, chunk),
        2 * escapes,
        escapes,
    )


def stream_offsets(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of each stream (each 16-byte aligned after the header) and the frame's total size."""
    offsets = []
    end = HEADER_SIZE
    for length in lengths:
        start = align(end)
        offsets.append(start)
        end = start + length
    # An empty trailing stream adds no padding: the frame ends where the last byte is.
    total = max([HEADER_SIZE] + [o + n for o, n in zip(offsets, lengths) if n])
    return tuple(offsets), total


def splitzip_size(layout: FloatLayout, numel: int, chunk: int, escapes: int) -> int:
    return stream_offsets(stream_lengths(layout, numel, chunk, escapes))[1]


def stored_size(layout: FloatLayout, numel: int) -> int:
    return HEADER_SIZE + numel * layout.itemsize


@dataclass(frozen=True)
class Header:
    """A parsed, validated frame header."""

    codec: FrameCodec
    layout: FloatLayout
    shape: tuple[int, ...]
    numel: int
    chunk: int
    codebook: tuple[int, ...]
    escapes: int
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    stream_crc: int | None

    def pack(self) -> bytes:
        """Header bytes, header CRC32C included."""
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        codebook = bytes(self.codebook) + bytes(16 - len(self.codebook))
        code_bits = self.layout.code_bits if self.codec == FrameCodec.SPLITZIP else 0
        body = _BODY.write(
            VERSION, int(self.codec), self.layout.wire_id, len(self.shape), code_bits,
            flags, 0, self.chunk, self.numel, *shape, codebook, self.escapes, *self.lengths,
            self.stream_crc or 0,
        )
        return body + _CRC.pack(crc32c(body))


def make_header(
    codec: FrameCodec,
    layout: FloatLayout,
    shape: tuple[int, ...],
    chunk: int,
    codebook: tuple[int, ...],
    escapes: int,
) -> Header:
    """Header for a frame about to be written (stream CRC filled in later with ``with_crc``)."""
    numel = 1
    for dim in shape:
        numel *= dim
    if codec == FrameCodec.STORED:
        lengths = (numel * layout.itemsize, 0, 0, 0, 0)
        chunk, codebook, escapes = 0, (), 0
    else:
        lengths = stream_lengths(layout, numel, chunk, escapes)
    offsets, total = stream_offsets(lengths)
    return Header(codec, layout, shape, numel, chunk, codebook, escapes, lengths, offsets, total, None)


def parse_header(buf: bytes, frame_size: int) -> Header:
    """Parse and validate a header against the frame's real size.

    Everything that later indexing depends on is checked here, so a frame that passes cannot
    make decode read or write out of bounds.

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"frame of {frame_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    body = bytes(buf[: _BODY.size])
    # The codec id is checked after the header's CRC: a frame of another codec fails that first.
    codec_id, (dtype_id, ndim, code_bits, flags, reserved, chunk, numel, *rest) = _BODY.read(body, version=VERSION)
    shape_all, (codebook_raw, escapes), lengths_and_crc = rest[:8], rest[8:10], rest[10:]
    lengths, stream_crc = tuple(lengths_and_crc[:5]), lengths_and_crc[5]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    layout = layout_by_wire_id(dtype_id)
    if layout is None:
        raise CorruptFrame(f"unknown dtype id {dtype_id}")
    try:
        codec = FrameCodec(codec_id)
    except ValueError:
        raise CorruptFrame(f"unknown codec id {codec_id}") from None
    if flags & ~FLAG_STREAM_CRC or reserved:
        raise CorruptFrame(f"unknown flags {flags:#x}")
    if ndim > MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    product = 1
    for dim in shape:
        product *= dim
    if product != numel:
        raise CorruptFrame(f"shape {shape} holds {product} elements, header says {numel}")
    codebook = tuple(codebook_raw)
    if codec == FrameCodec.STORED:
        if code_bits or chunk or escapes or any(codebook):
            raise CorruptFrame("stored frame carries coding fields")
        expected = (numel * layout.itemsize, 0, 0, 0, 0)
    else:
        if code_bits != layout.code_bits:
            raise CorruptFrame(f"code width {code_bits} is not {layout.code_bits} for {layout.name}")
        if not 1 <= chunk <= MAX_CHUNK:
            raise CorruptFrame(f"chunk size {chunk} out of range 1..{MAX_CHUNK}")
        if escapes > numel:
            raise CorruptFrame(f"{escapes} escapes for {numel} elements")
        size = layout.codebook_size
        codebook, padding = codebook[:size], codebook[size:]
        if any(padding):
            raise CorruptFrame("codebook padding is not zero")
        if max(codebook) >= 1 << layout.exp_bits or len(set(codebook)) != size:
            raise CorruptFrame(f"codebook {codebook} is not {size} distinct {layout.exp_bits}-bit exponents")
        expected = stream_lengths(layout, numel, chunk, escapes)
    if lengths != expected:
        raise CorruptFrame(f"stream lengths {lengths} disagree with the header, expected {expected}")
    offsets, total = stream_offsets(lengths)
    if frame_size != total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {total}")
    crc = stream_crc if flags & FLAG_STREAM_CRC else None
    if crc is None and stream_crc:
        raise CorruptFrame("stream checksum present without its flag")
    return Header(codec, layout, shape, numel, chunk, codebook, escapes, lengths, offsets, total, crc)
