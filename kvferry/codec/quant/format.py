"""The quant frame's byte layout (quant format version 1): the one place that knows it.

See ``kvferry/codec/quant/FORMAT.md``. A frame is a 112-byte header and three streams, each
starting 16-byte aligned: all K codes, all V codes, then the parameters (K's (scale, zero) fp16
pairs, then V's). Vector ``j`` of a kind owns ``C*bits/8`` consecutive code bytes, so a GPU tile
of consecutive vectors reads and writes one contiguous run per stream.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..checksum import crc32c
from ..errors import CodebookMismatch, CorruptFrame, UnsupportedTensor
from .. import prefix

QUANT_VERSION = 1
MAX_NDIM = 8
STREAM_ALIGN = 16
FLAG_STREAM_CRC = 0x01
PARAM_BYTES = 4  # fp16 scale, fp16 zero per vector
FP16_MAX = 65504.0
DTYPE_IDS = {torch.bfloat16: 1, torch.float16: 2}  # the wire ids of codec/FORMAT.md
DTYPES = {v: k for k, v in DTYPE_IDS.items()}
BITS = {3: (8, 4), 4: (4, 2)}  # frame id -> (K bits, V bits)

# magic, version, codec, dtype, ndim, kv axis, channel axis, K bits, V bits, flags, reserved,
# shape[8], stream lengths[3], stream crc
_BODY = prefix.Body("BBBBBBBH8Q3QI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 112


class Stream:
    K, V, PARAMS = range(3)


def align(n: int) -> int:
    return (n + STREAM_ALIGN - 1) // STREAM_ALIGN * STREAM_ALIGN


@dataclass(frozen=True)
class QuantHeader:
    """A parsed, validated quant frame header."""

    frame_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    kv_axis: int
    channel_axis: int
    stream_crc: int | None = None

    @property
    def bits(self) -> tuple[int, int]:
        return BITS[self.frame_id]

    @property
    def channels(self) -> int:
        return self.shape[self.channel_axis]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def vectors(self) -> int:
        """Vectors per kind (K or V)."""
        return self.numel // (2 * self.channels)

    @property
    def lengths(self) -> tuple[int, int, int]:
        half = self.numel // 2
        return half * self.bits[0] // 8, half * self.bits[1] // 8, 2 * PARAM_BYTES * self.vectors

    @property
    def offsets(self) -> tuple[int, int, int]:
        k, v, _ = self.lengths
        return HEADER_SIZE, align(HEADER_SIZE + k), align(align(HEADER_SIZE + k) + v)

    @property
    def total(self) -> int:
        ends = [o + n for o, n in zip(self.offsets, self.lengths) if n]
        return max([HEADER_SIZE] + ends)

    def pack(self) -> bytes:
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _BODY.write(QUANT_VERSION, self.frame_id, DTYPE_IDS[self.dtype], len(self.shape),
                          self.kv_axis, self.channel_axis, *self.bits, flags, 0, *shape, *self.lengths,
                          self.stream_crc or 0)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> QuantHeader:
        return replace(self, stream_crc=crc)


def check_geometry(shape: Sequence[int], kv_axis: int, channel_axis: int, bits: tuple[int, int]) -> None:
    """Whether a tensor of ``shape`` can be coded with these axes and bit widths.

    Raises:
        CodebookMismatch: an axis outside the tensor, the two axes equal, or a kv axis not of 2.
        UnsupportedTensor: too many dimensions, or vectors whose codes would not fill whole bytes.
    """
    if len(shape) > MAX_NDIM:
        raise UnsupportedTensor(f"tensors of up to {MAX_NDIM} dimensions, got {len(shape)}")
    if not (0 <= kv_axis < len(shape) and 0 <= channel_axis < len(shape)) or kv_axis == channel_axis:
        raise CodebookMismatch(f"kv axis {kv_axis} and channel axis {channel_axis} must be two different "
                               f"axes of a {len(shape)}-d tensor")
    if shape[kv_axis] != 2:
        raise CodebookMismatch(f"the kv axis ({kv_axis}) has {shape[kv_axis]} entries, not 2 (K, V)")
    c = shape[channel_axis]
    if c < 1 or any(c * b % 8 for b in bits):
        raise UnsupportedTensor(f"{c} channels: a vector's {min(bits)}-bit codes must fill whole bytes")


def frame_size(shape: Sequence[int], kv_axis: int, channel_axis: int, frame_id: int) -> int:
    """Exact bytes of the frame of a tensor of ``shape`` (geometry already checked)."""
    return QuantHeader(frame_id, torch.bfloat16, tuple(shape), kv_axis, channel_axis).total


def parse_header(buf: bytes, frame_size: int) -> QuantHeader:
    """Parse and check a header against the frame's real size.

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"quant frame of {frame_size} bytes is shorter than its {HEADER_SIZE}-byte header")
    body = bytes(buf[:_BODY.size])
    frame_id, (dtype_id, ndim, kv_axis, channel_axis, k_bits, v_bits, flags, reserved,
               *rest) = _BODY.read(body, version=QUANT_VERSION, codec_ids=BITS, name="quant")
    shape_all, lengths, stream_crc = rest[:MAX_NDIM], tuple(rest[MAX_NDIM:MAX_NDIM + 3]), rest[-1]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    if dtype_id not in DTYPES:
        raise CorruptFrame(f"dtype id {dtype_id} is not bfloat16 (1) or float16 (2)")
    if (k_bits, v_bits) != BITS[frame_id]:
        raise CorruptFrame(f"K/V bits {k_bits}/{v_bits}; codec {frame_id} codes {BITS[frame_id]}")
    if flags & ~FLAG_STREAM_CRC or reserved or (not flags & FLAG_STREAM_CRC and stream_crc):
        raise CorruptFrame(f"unknown flags or reserved bits {flags:#x}")
    if not 1 <= ndim <= MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    numel = 1
    for d in shape:
        numel *= d
    if numel >= 1 << 48:
        raise CorruptFrame(f"shape {shape} is implausibly large")
    try:
        check_geometry(shape, kv_axis, channel_axis, BITS[frame_id])
    except (CodebookMismatch, UnsupportedTensor) as exc:
        raise CorruptFrame(f"bad geometry: {exc}") from None
    header = QuantHeader(frame_id, DTYPES[dtype_id], shape, kv_axis, channel_axis,
                         stream_crc if flags & FLAG_STREAM_CRC else None)
    if lengths != header.lengths:
        raise CorruptFrame(f"stream lengths {lengths} disagree with the shape (expected {header.lengths})")
    if frame_size != header.total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {header.total}")
    return header
