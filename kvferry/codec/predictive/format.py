"""The predictive frame's byte layout (predictive format version 1): the one place that knows it.

A frame is a 112-byte header and
two streams, 8-byte aligned by construction::

    header  magic "KVFZ", u16 version 1, u8 codec id 7, u8 dtype id, u8 reference dtype id,
            u8 ndim, u16 flags, u32 lanes, u64 numel, u64 sigma digest,
            u64 shape[8], u64 words, u32 stream crc, u32 header crc (CRC32C of the bytes before)
    states  lanes x u64 LE: the rANS coder's final state per lane
    words   words x u32 LE: the rANS words, in decoding order

The codebook (sigma table, marginal) and the reference (the predictor's KV) are not in the
frame: both sides hold them; the digest names the codebook so a mismatch is refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from ..checksum import crc32c
from ..errors import CorruptFrame
from .. import prefix

PREDICTIVE_VERSION = 1
FRAME_ID = 7
MAX_NDIM = 8
MAX_LANES = 1 << 16
FLAG_STREAM_CRC = 0x0001
# Reference dtypes by wire id (the target's dtype uses the codec-wide ids of dtypes.py).
REFERENCE_DTYPES = {1: "bfloat16", 2: "float16", 3: "float8_e5m2", 4: "float8_e4m3fn", 5: "float32"}
REFERENCE_IDS = {name: i for i, name in REFERENCE_DTYPES.items()}

_BODY = prefix.Body("BBBHIQQ8QQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 112


def min_lanes(numel: int) -> int:
    """The fewest lanes the encoder gives ``numel`` elements: one per 256 elements up to 64, at
    least one. A decoder refuses fewer, since it takes one sequential step per ``numel / lanes``
    elements: a frame of one lane would cost it 64 times the steps of the encoder's own frame."""
    return max(1, min(64, numel // 256))


def lanes_for(numel: int, coded_bits: float) -> int:
    """Interleaved coder lanes (the encoder's choice; decoders read the header): as many as keep
    the 8-byte final states within ~0.5% of the coded size, never fewer than ``min_lanes`` (more
    lanes, fewer sequential decode steps); 1..4096, at most numel."""
    return int(max(min_lanes(numel), min(4096, numel, coded_bits // (8 * 1600))))


@dataclass(frozen=True)
class PredictiveHeader:
    """A parsed, validated predictive frame header."""

    dtype_id: int
    reference_id: int
    shape: tuple[int, ...]
    numel: int
    lanes: int
    digest: int
    words: int
    stream_crc: int | None

    @property
    def states_offset(self) -> int:
        return HEADER_SIZE

    @property
    def words_offset(self) -> int:
        return HEADER_SIZE + 8 * self.lanes

    @property
    def total(self) -> int:
        return self.words_offset + 4 * self.words

    @property
    def reference_dtype(self) -> str:
        return REFERENCE_DTYPES[self.reference_id]

    def pack(self) -> bytes:
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _BODY.write(PREDICTIVE_VERSION, FRAME_ID, self.dtype_id, self.reference_id,
                          len(self.shape), flags, self.lanes, self.numel, self.digest, *shape, self.words,
                          self.stream_crc or 0)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> PredictiveHeader:
        return replace(self, stream_crc=crc)


def parse_header(buf: bytes, frame_size: int) -> PredictiveHeader:
    """Parse and check a header against the frame's real size.

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"predictive frame of {frame_size} bytes is shorter than its {HEADER_SIZE}-byte header")
    body = bytes(buf[:_BODY.size])
    _, (dtype_id, reference_id, ndim, flags, lanes, numel, digest,
        *rest) = _BODY.read(body, version=PREDICTIVE_VERSION, codec_ids=(FRAME_ID,), name="predictive")
    shape_all, words, stream_crc = rest[:MAX_NDIM], rest[MAX_NDIM], rest[MAX_NDIM + 1]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    if flags & ~FLAG_STREAM_CRC or (not flags & FLAG_STREAM_CRC and stream_crc):
        raise CorruptFrame(f"unknown flags {flags:#x}")
    if reference_id not in REFERENCE_DTYPES:
        raise CorruptFrame(f"unknown reference dtype id {reference_id}")
    if ndim > MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    product = 1
    for dim in shape:
        product *= dim
    if product != numel or numel < 1:
        raise CorruptFrame(f"shape {shape} holds {product} elements, header says {numel}")
    if not min_lanes(numel) <= lanes <= min(MAX_LANES, numel):
        raise CorruptFrame(f"{lanes} coder lanes for {numel} elements; the encoder gives them "
                           f"{min_lanes(numel)}..{min(MAX_LANES, numel)}")
    if words > numel:  # at most one 32-bit word per element
        raise CorruptFrame(f"{words} words for {numel} elements")
    header = PredictiveHeader(dtype_id, reference_id, shape, numel, lanes, digest, words,
                              stream_crc if flags & FLAG_STREAM_CRC else None)
    if frame_size != header.total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {header.total}")
    return header
