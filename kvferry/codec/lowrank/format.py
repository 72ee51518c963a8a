"""The lowrank frame's byte layout (lowrank format version 1): the one place that knows it.

See ``FORMAT.md`` beside this file. A frame is a 128-byte header (the shared 7-byte prefix,
codec id 5) followed by two streams back to back: the per-vector quantizer parameters (empty
unless the codebook quantizes) and the coefficients.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from ..checksum import crc32c
from ..dtypes import FloatLayout, layout_by_wire_id
from ..errors import CorruptFrame
from .. import prefix

LOWRANK_VERSION = 1
FRAME_ID = 5
MAX_NDIM = 8
NO_AXIS = 0xFF
FLAG_K8V4 = 0x01
SUPPORTED_DTYPES = ("bfloat16", "float16")

# magic, version, codec, dtype, ndim, flags, axis positions (layer, kv, head, channel),
# reserved, dims (layers, kv, heads, channels), codebook digest, shape[8], vectors per group,
# stream lengths (params, coefficients), stream crc; then the header crc
_BODY = prefix.Body("BBB4BH4H8s8QQ2QI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 128, HEADER_SIZE


@dataclass(frozen=True)
class LowRankHeader:
    """A parsed lowrank frame header (its stream lengths checked against a codebook later)."""

    layout: FloatLayout
    shape: tuple[int, ...]
    positions: tuple[int | None, int | None, int | None, int]  # layer, kv, head, channel
    dims: tuple[int, int, int, int]
    quantized: bool
    digest: bytes
    vectors: int
    lengths: tuple[int, int]
    stream_crc: int

    @property
    def total(self) -> int:
        return HEADER_SIZE + sum(self.lengths)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def pack(self) -> bytes:
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        pos = [NO_AXIS if p is None else p for p in self.positions]
        body = _BODY.write(LOWRANK_VERSION, FRAME_ID, self.layout.wire_id, len(self.shape),
                          FLAG_K8V4 if self.quantized else 0, *pos, 0, *self.dims, self.digest, *shape,
                          self.vectors, *self.lengths, self.stream_crc)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> LowRankHeader:
        return replace(self, stream_crc=crc)


def parse_header(buf: bytes, frame_size: int) -> LowRankHeader:
    """Parse and check a header against the frame's real size (stream lengths against the
    codebook: ``check_lengths``).

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"lowrank frame of {frame_size} bytes is shorter than its {HEADER_SIZE}-byte header")
    body = bytes(buf[:_BODY.size])
    _, (dtype_id, ndim, flags, p_layer, p_kv, p_head, p_channel, reserved2,
        layers, kv, heads, channels, digest, *rest) = _BODY.read(body, version=LOWRANK_VERSION,
                                                                   codec_ids=(FRAME_ID,), name="lowrank")
    shape_all, vectors, lengths, stream_crc = rest[:8], rest[8], (rest[9], rest[10]), rest[11]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    layout = layout_by_wire_id(dtype_id)
    if layout is None or layout.name not in SUPPORTED_DTYPES:
        raise CorruptFrame(f"dtype id {dtype_id} is not one lowrank codes")
    if flags & ~FLAG_K8V4 or reserved2:
        raise CorruptFrame(f"unknown flags or reserved bits {flags:#x}")
    if not 1 <= ndim <= MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    positions = tuple(None if p == NO_AXIS else p for p in (p_layer, p_kv, p_head, p_channel))
    named = [p for p in positions if p is not None]
    if positions[3] is None or len(set(named)) != len(named) or any(p >= ndim for p in named):
        raise CorruptFrame(f"bad axis positions {positions} for a tensor of {ndim} dimensions")
    dims = (layers, kv, heads, channels)
    for p, size in zip(positions, dims):
        if (shape[p] if p is not None else 1) != size:
            raise CorruptFrame(f"shape {shape} disagrees with the dims {dims} at axis positions {positions}")
    n_groups = layers * kv * heads
    numel = 1
    for s in shape:
        numel *= s
    if n_groups * vectors * channels != numel:
        raise CorruptFrame(f"{vectors} vectors per group disagree with shape {shape}")
    header = LowRankHeader(layout, shape, positions, dims, bool(flags & FLAG_K8V4), digest, vectors, lengths,
                           stream_crc)
    if frame_size != header.total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {header.total}")
    return header
