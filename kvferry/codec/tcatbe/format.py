"""The tca-tbe frame's byte layout (tca-tbe format version 1): the one place that knows it.

See ``FORMAT.md`` beside this module. A frame is a 112-byte header (the shared 7-byte prefix:
magic, version, codec id 6) and five streams, each starting 16-byte aligned:

    0 BITMAPS   tiles x 3 u64      bit p of plane k = bit k of the 3-bit code of element 64*t+p
    1 GROUPS    groups x u64       in-window elements before group g (a group is 1024 tiles)
    2 TILES     tiles x u16        in-window elements from the tile's group start to the tile
    3 SIGNMAN   in_window x u8     sign << 7 | mantissa of each in-window element, in order
    4 FALLBACK  fallback x u16     every other element, all 16 bits, in order

All integers little-endian. Code c in 1..7 means exponent ``window_low + c - 1`` (the paper's
BaseExp is ``window_low - 1``); code 0 means the element is in FALLBACK. Padding elements of the
last tile have code 0 and are stored nowhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import torch

from ..checksum import crc32c
from ..dtypes import layout_by_wire_id
from ..errors import CorruptFrame
from .. import prefix

TCATBE_VERSION = 1
FRAME_ID = 6
TILE = 64              # elements per tile: an 8x8 FragTile of the flattened tensor
PLANES = 3             # bits per code, one 64-bit bitmap each
WINDOW = 7             # exponents a window covers (codes 1..7)
GROUP_TILES = 1024     # tiles per group: a tile's offset within its group fits a u16
MAX_WINDOW_LOW = 256 - WINDOW
MAX_NDIM = 8
STREAM_ALIGN = 16
FLAG_STREAM_CRC = 0x01
NUM_STREAMS = 5

# magic, version, codec, dtype, ndim, window_low, flags, reserved, numel, shape[8], in_window,
# fallback, reserved, stream crc; then the CRC32C of those 108 bytes.
_BODY = prefix.Body("BBBBBQ8QQQII")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 112


class Stream:
    BITMAPS, GROUPS, TILES, SIGNMAN, FALLBACK = range(NUM_STREAMS)


def align(n: int) -> int:
    return (n + STREAM_ALIGN - 1) // STREAM_ALIGN * STREAM_ALIGN


def num_tiles(numel: int) -> int:
    return (numel + TILE - 1) // TILE


def num_groups(tiles: int) -> int:
    return (tiles + GROUP_TILES - 1) // GROUP_TILES


def stream_lengths(numel: int, in_window: int) -> tuple[int, ...]:
    tiles = num_tiles(numel)
    return (8 * PLANES * tiles, 8 * num_groups(tiles), 2 * tiles, in_window, 2 * (numel - in_window))


def stream_offsets(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of the streams (each 16-byte aligned after the header) and the frame's size; the
    frame ends where its last non-empty stream ends."""
    offsets, end = [], HEADER_SIZE
    for length in lengths:
        start = align(end)
        offsets.append(start)
        end = start + length
    total = max([HEADER_SIZE] + [o + n for o, n in zip(offsets, lengths) if n])
    return tuple(offsets), total


def frame_size(numel: int, in_window: int) -> int:
    """Bytes of a tca-tbe frame of ``numel`` elements, ``in_window`` of them coded."""
    return stream_offsets(stream_lengths(numel, in_window))[1]


@dataclass(frozen=True)
class TcaTbeHeader:
    """A parsed, validated tca-tbe frame header."""

    wire_id: int
    shape: tuple[int, ...]
    numel: int
    window_low: int
    in_window: int
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    stream_crc: int | None

    @property
    def fallback(self) -> int:
        return self.numel - self.in_window

    @property
    def tiles(self) -> int:
        return num_tiles(self.numel)

    def pack(self) -> bytes:
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _BODY.write(TCATBE_VERSION, FRAME_ID, self.wire_id, len(self.shape), self.window_low,
                          flags, 0, self.numel, *shape, self.in_window, self.fallback, 0, self.stream_crc or 0)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> TcaTbeHeader:
        return replace(self, stream_crc=crc)


def make_header(wire_id: int, shape: tuple[int, ...], window_low: int, in_window: int) -> TcaTbeHeader:
    """Header of a frame about to be written (no stream CRC yet)."""
    numel = 1
    for dim in shape:
        numel *= dim
    lengths = stream_lengths(numel, in_window)
    offsets, total = stream_offsets(lengths)
    return TcaTbeHeader(wire_id, tuple(shape), numel, window_low, in_window, lengths, offsets, total, None)


def parse_header(buf: bytes, frame_size: int, supported_wire_ids: frozenset[int]) -> TcaTbeHeader:
    """Parse and check a header against the frame's real size. What the streams must then hold
    (offsets that agree with the bitmaps, zero padding) is checked by the decoders.

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"tca-tbe frame of {frame_size} bytes is shorter than its {HEADER_SIZE}-byte header")
    body = bytes(buf[:_BODY.size])
    _, (dtype_id, ndim, window_low, flags, reserved, numel, *rest) = _BODY.read(
        body, version=TCATBE_VERSION, codec_ids=(FRAME_ID,), name="tca-tbe")
    shape_all, in_window, fallback, reserved2, stream_crc = rest[:8], rest[8], rest[9], rest[10], rest[11]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    if layout_by_wire_id(dtype_id) is None or dtype_id not in supported_wire_ids:
        raise CorruptFrame(f"dtype id {dtype_id} is not one tca-tbe codes")
    if flags & ~FLAG_STREAM_CRC or reserved or reserved2 or (not flags & FLAG_STREAM_CRC and stream_crc):
        raise CorruptFrame(f"unknown flags or reserved bits {flags:#x}")
    if window_low > MAX_WINDOW_LOW:
        raise CorruptFrame(f"window starting at exponent {window_low} runs past 255")
    if ndim > MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    product = 1
    for dim in shape:
        product *= dim
    if product != numel or numel >= 1 << 48:
        raise CorruptFrame(f"shape {shape} holds {product} elements, header says {numel}")
    if in_window + fallback != numel:
        raise CorruptFrame(f"{in_window} in-window and {fallback} fallback elements are not {numel}")
    lengths = stream_lengths(numel, in_window)
    offsets, total = stream_offsets(lengths)
    if frame_size != total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {total}")
    return TcaTbeHeader(dtype_id, shape, numel, window_low, in_window, lengths, offsets, total,
                        stream_crc if flags & FLAG_STREAM_CRC else None)


def padding_ranges(header: TcaTbeHeader) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` between the streams, which must be zero."""
    ranges, end = [], HEADER_SIZE
    for offset, length in zip(header.offsets, header.lengths):
        if length:
            if offset > end:
                ranges.append((end, offset))
            end = offset + length
    return ranges


def finish(frame: torch.Tensor, header: TcaTbeHeader, checksum: bool) -> torch.Tensor:
    """Write the header into a frame whose streams are in place (CRC over a host copy): the
    header's one writer, for the reference and the GPU kernels alike."""
    if checksum:
        header = header.with_crc(crc32c(memoryview(frame[HEADER_SIZE:].cpu().numpy())))
    packed = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    frame[:HEADER_SIZE].copy_(packed.to(frame.device))
    return frame
