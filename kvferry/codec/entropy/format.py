"""The entropy frame's byte layout (entropy format version 2): the one place that knows it.

See the "entropy" section of ``kvferry/codec/FORMAT.md``. A frame is the shared 7-byte prefix
(magic, version, codec id 2), this codec's header, and five streams each 16-byte aligned: the
tables, the context map, per-chunk word counts, the code words (32-bit), and the raw bits.
How the words are ordered (lanes, segments, refill points) is ``reference.py``'s.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import numpy as np

from ..checksum import crc32c
from ..dtypes import layout_by_wire_id
from ..errors import CorruptFrame
from ..registry import FRAME_MAGIC
from .codebook import MAX_CONTEXTS, MAX_TABLES, EntropyCodebook, check_tables
from .symbols import Geometry, SymbolLayout, symbol_layout

ENTROPY_VERSION = 2
FRAME_ID = 2
LANES = 32
DEFAULT_CHUNK = 32768  # elements per chunk: 1024 steps of 32 lanes
MAX_CHUNK = 1 << 20
MAX_NDIM = 8
STREAM_ALIGN = 16
FLAG_STREAM_CRC = 0x01
STEPS_PER_GROUP = 32  # a group: 32 steps of 32 lanes, split into segments of SEGMENT steps
SEGMENT = 3  # steps between two refill points (at most 3 codes of CODE_BITS in a 32-bit word)
NUM_STREAMS = 5

# magic, version, codec, dtype, ndim, prob_bits, flags, tables, lanes, reserved, chunk,
# geometry (outer, tokens, inner), numel, shape[8], stream lengths[5], reserved, stream crc
_BODY = struct.Struct("<4sHBBBBBBHHI3QQ8Q5QII")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 168
HEADER_BODY = _BODY.size  # the bytes the header's CRC covers
WORDS_LENGTH_AT = struct.calcsize("<4sHBBBBBBHHI3QQ8Q") + 8 * 3  # the word stream's length (u64) in the header


class Stream:
    TABLES, MAP, COUNTS, WORDS, RAW = range(NUM_STREAMS)


def align(n: int) -> int:
    return (n + STREAM_ALIGN - 1) // STREAM_ALIGN * STREAM_ALIGN


def num_chunks(numel: int, chunk: int) -> int:
    return (numel + chunk - 1) // chunk


def word_cap(elements: int, sym: SymbolLayout) -> int:
    """32-bit words of a chunk of ``elements`` stored raw (its symbols packed): a coded chunk
    takes fewer, a chunk of exactly this many is a stored chunk."""
    return (elements * sym.sym_bits + 31) // 32


def chunk_caps(numel: int, chunk: int, sym: SymbolLayout) -> np.ndarray:
    n = num_chunks(numel, chunk)
    caps = np.full(n, word_cap(chunk, sym), dtype=np.int64)
    if n and numel % chunk:
        caps[-1] = word_cap(numel % chunk, sym)
    return caps


def stream_offsets(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of the streams (each 16-byte aligned after the header) and the frame's size; an
    empty trailing stream adds no padding."""
    offsets, end = [], HEADER_SIZE
    for length in lengths:
        start = align(end)
        offsets.append(start)
        end = start + length
    total = max([HEADER_SIZE] + [o + n for o, n in zip(offsets, lengths) if n])
    return tuple(offsets), total


def pack_codebook(book: EntropyCodebook) -> bytes:
    """Streams 0 and 1: the tables (per table u16 k, k u16 symbols, k u16 frequencies) and the map."""
    parts = []
    for row in book.freqs:
        symbols = np.flatnonzero(row).astype("<u2")
        parts += [struct.pack("<H", symbols.size), symbols.tobytes(), row[symbols].astype("<u2").tobytes()]
    return b"".join(parts)


def tables_length(book: EntropyCodebook) -> int:
    return int(sum(2 + 4 * np.count_nonzero(row) for row in book.freqs))


@dataclass(frozen=True)
class EntropyHeader:
    """A parsed, validated entropy frame header."""

    sym: SymbolLayout
    shape: tuple[int, ...]
    numel: int
    prob_bits: int
    tables: int
    chunk: int
    geometry: Geometry
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    stream_crc: int | None

    @property
    def nchunks(self) -> int:
        return num_chunks(self.numel, self.chunk)

    def pack(self) -> bytes:
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        g = self.geometry
        body = _BODY.pack(FRAME_MAGIC, ENTROPY_VERSION, FRAME_ID, self.sym.layout.wire_id, len(self.shape),
                          self.prob_bits, flags, self.tables, LANES, 0, self.chunk, g.outer, g.tokens, g.inner,
                          self.numel, *shape, *self.lengths, 0, self.stream_crc or 0)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> EntropyHeader:
        return replace(self, stream_crc=crc)

    def with_words(self, words: int) -> EntropyHeader:
        """This header with ``words`` 32-bit code words (``make_header`` without its table walk)."""
        lengths = self.lengths[:Stream.WORDS] + (4 * words,) + self.lengths[Stream.WORDS + 1:]
        offsets, total = stream_offsets(lengths)
        return replace(self, lengths=lengths, offsets=offsets, total=total)


def make_header(sym: SymbolLayout, shape: tuple[int, ...], book: EntropyCodebook, chunk: int,
                words: int) -> EntropyHeader:
    """Header of a frame about to be written, ``words`` 32-bit code words in all."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    n = num_chunks(numel, chunk)
    lengths = (tables_length(book), book.geometry.contexts, 4 * n, 4 * words,
               (numel * sym.raw_bits + 7) // 8)
    offsets, total = stream_offsets(lengths)
    return EntropyHeader(sym, tuple(shape), numel, book.prob_bits, book.tables, chunk, book.geometry,
                         lengths, offsets, total, None)


def parse_header(buf: bytes, frame_size: int) -> EntropyHeader:
    """Parse and check a header against the frame's real size; what the streams must then hold
    (tables, counts) is checked by ``parse_tables`` and ``check_counts``.

    Raises:
        CorruptFrame: with the first reason found.
    """
    if frame_size < HEADER_SIZE or len(buf) < HEADER_SIZE:
        raise CorruptFrame(f"entropy frame of {frame_size} bytes is shorter than its {HEADER_SIZE}-byte header")
    body = bytes(buf[:_BODY.size])
    (magic, version, codec_id, dtype_id, ndim, prob_bits, flags, tables, lanes, reserved, chunk,
     outer, tokens, inner, numel, *rest) = _BODY.unpack(body)
    shape_all, lengths, reserved2, stream_crc = rest[:8], tuple(rest[8:13]), rest[13], rest[14]
    if magic != FRAME_MAGIC:
        raise CorruptFrame(f"bad magic {magic!r}, expected {FRAME_MAGIC!r}")
    if codec_id != FRAME_ID:
        raise CorruptFrame(f"codec id {codec_id} is not the entropy codec's {FRAME_ID}")
    if version != ENTROPY_VERSION:
        raise CorruptFrame(f"unsupported entropy format version {version} (this build reads {ENTROPY_VERSION})")
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    layout = layout_by_wire_id(dtype_id)
    if layout is None:
        raise CorruptFrame(f"unknown dtype id {dtype_id}")
    sym = symbol_layout(layout)
    if flags & ~FLAG_STREAM_CRC or reserved or reserved2 or (not flags & FLAG_STREAM_CRC and stream_crc):
        raise CorruptFrame(f"unknown flags or reserved bits {flags:#x}")
    if lanes != LANES:
        raise CorruptFrame(f"{lanes} lanes; this build codes {LANES}")
    if not (LANES <= chunk <= MAX_CHUNK and chunk % LANES == 0):
        raise CorruptFrame(f"chunk of {chunk} elements is not a multiple of {LANES} in {LANES}..{MAX_CHUNK}")
    if not 1 <= tables <= MAX_TABLES:
        raise CorruptFrame(f"{tables} tables")
    geometry = Geometry(outer, tokens, inner)
    if min(outer, tokens, inner) < 1 or outer * inner > MAX_CONTEXTS or outer * tokens * inner >= 1 << 48:
        raise CorruptFrame(f"bad context geometry {geometry}")
    if ndim > MAX_NDIM or any(shape_all[ndim:]):
        raise CorruptFrame(f"bad rank {ndim}")
    shape = tuple(shape_all[:ndim])
    product = 1
    for dim in shape:
        product *= dim
    if product != numel:
        raise CorruptFrame(f"shape {shape} holds {product} elements, header says {numel}")
    n = num_chunks(numel, chunk)
    caps_total = (n - 1) * word_cap(chunk, sym) + word_cap(numel - (n - 1) * chunk, sym) if n else 0
    fixed = (geometry.contexts, 4 * n, (numel * sym.raw_bits + 7) // 8)
    got = (lengths[Stream.MAP], lengths[Stream.COUNTS], lengths[Stream.RAW])
    if got != fixed:
        raise CorruptFrame(f"stream lengths {lengths} disagree with the header")
    if lengths[Stream.WORDS] % 4 or lengths[Stream.WORDS] > 4 * caps_total:
        raise CorruptFrame(f"word stream of {lengths[Stream.WORDS]} bytes")
    if not 2 * tables <= lengths[Stream.TABLES] <= tables * (2 + 4 * sym.alphabet):
        raise CorruptFrame(f"table stream of {lengths[Stream.TABLES]} bytes for {tables} tables")
    offsets, total = stream_offsets(lengths)
    if frame_size != total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {total}")
    return EntropyHeader(sym, shape, numel, prob_bits, tables, chunk, geometry, lengths, offsets, total,
                         stream_crc if flags & FLAG_STREAM_CRC else None)


def parse_tables(header: EntropyHeader, table_bytes: bytes, map_bytes: bytes) -> EntropyCodebook:
    """The codebook a frame carries, checked completely (the decoder indexes with it).

    Raises:
        CorruptFrame: malformed tables or map.
    """
    sym = header.sym
    freqs = np.zeros((header.tables, sym.alphabet), dtype=np.int32)
    pos, data = 0, table_bytes
    for t in range(header.tables):
        if pos + 2 > len(data):
            raise CorruptFrame("table stream ends inside a table")
        (k,) = struct.unpack_from("<H", data, pos)
        end = pos + 2 + 4 * k
        if not 1 <= k <= sym.alphabet or end > len(data):
            raise CorruptFrame(f"table {t} has a bad symbol count {k}")
        symbols = np.frombuffer(data, dtype="<u2", count=k, offset=pos + 2).astype(np.int64)
        counts = np.frombuffer(data, dtype="<u2", count=k, offset=pos + 2 + 2 * k).astype(np.int32)
        if (np.diff(symbols) <= 0).any() or symbols[-1] >= sym.alphabet or (counts == 0).any():
            raise CorruptFrame(f"table {t}: symbols not increasing, out of range, or zero frequencies")
        freqs[t, symbols] = counts
        pos = end
    if pos != len(data):
        raise CorruptFrame("table stream has trailing bytes")
    cmap = np.frombuffer(map_bytes, dtype=np.uint8).copy()
    problem = check_tables(freqs, cmap, header.prob_bits, sym, header.geometry)
    if problem:
        raise CorruptFrame(f"frame's codebook: {problem}")
    return EntropyCodebook(sym.layout.name, header.prob_bits, header.geometry, freqs, cmap)


def check_counts(header: EntropyHeader, counts: np.ndarray) -> np.ndarray:
    """Word offset of each chunk (n+1 entries) from the counts stream, checked against each
    chunk's cap and the word stream's length.

    Raises:
        CorruptFrame: a count over its chunk's cap, or counts that do not add up.
    """
    counts = counts.astype(np.int64)
    if (counts > chunk_caps(header.numel, header.chunk, header.sym)).any():
        raise CorruptFrame("a chunk's word count exceeds its cap")
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    if 4 * int(starts[-1]) != header.lengths[Stream.WORDS]:
        raise CorruptFrame("chunk word counts disagree with the word stream's length")
    return starts
