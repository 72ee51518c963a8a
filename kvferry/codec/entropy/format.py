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
from .. import prefix
from .codebook import MAX_CONTEXTS, MAX_TABLES
from .huffman import CODE_BITS, CodeTables, check_lengths
from .symbols import Geometry, SymbolLayout, symbol_layout

ENTROPY_VERSION = 2
FRAME_ID = 2
LANES = 32
DEFAULT_CHUNK = 32768  # elements per chunk: 1024 steps of 32 lanes
# The largest chunk encoders write and decoders take: the reference decoder walks a chunk's
# steps one by one, so a frame's cost beyond its bytes grows with its chunk.
MAX_CHUNK = DEFAULT_CHUNK
MAX_NDIM = 8
STREAM_ALIGN = 16
FLAG_STREAM_CRC = 0x01
STEPS_PER_GROUP = 32  # a group: 32 steps of 32 lanes, split into segments of SEGMENT steps
SEGMENT = 3  # steps between two refill points (at most 3 codes of CODE_BITS in a 32-bit word)
NUM_STREAMS = 5

# magic, version, codec, dtype, ndim, code_bits, flags, tables, lanes, reserved, chunk,
# geometry (outer, tokens, inner), numel, shape[8], stream lengths[5], reserved, stream crc
_BODY = prefix.Body("BBBBBHHI3QQ8Q5QII")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 168
HEADER_BODY = _BODY.size  # the bytes the header's CRC covers
WORDS_LENGTH_AT = prefix.SIZE + struct.calcsize("<BBBBBHHI3QQ8Q") + 8 * 3  # the word stream's length (u64) in the header


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


def _bitmap_bytes(sym: SymbolLayout) -> int:
    return (sym.alphabet + 7) // 8


def pack_tables(ct: CodeTables) -> bytes:
    """Stream 0: per table a bitmap of the symbols it codes (LSB first), then their code lengths
    in symbol order, 4 bits each (low nibble first, a last odd nibble 0)."""
    parts = []
    for row in ct.lengths:
        present = row > 0
        parts.append(np.packbits(present, bitorder="little").tobytes())
        nib = row[present].astype(np.uint8)
        if nib.size % 2:
            nib = np.append(nib, np.uint8(0))
        parts.append((nib[0::2] | nib[1::2] << 4).astype(np.uint8).tobytes())
    return b"".join(parts)


def tables_length(ct: CodeTables) -> int:
    per = _bitmap_bytes(ct.sym)
    return int(sum(per + (np.count_nonzero(row) + 1) // 2 for row in ct.lengths))


def map_bits(tables: int) -> int:
    """Bits of a context map entry: as few as name every table."""
    return max(1, (tables - 1).bit_length())


def map_length(contexts: int, tables: int) -> int:
    return (contexts * map_bits(tables) + 7) // 8


def pack_map(ct: CodeTables) -> bytes:
    """Stream 1: the table of each context, ``map_bits`` bits each, LSB first."""
    b = map_bits(ct.tables)
    bits = (ct.context_map.astype(np.int64)[:, None] >> np.arange(b)) & 1
    return np.packbits(bits.reshape(-1).astype(np.uint8), bitorder="little").tobytes()


def unpack_map(data: bytes, contexts: int, tables: int) -> np.ndarray:
    b = map_bits(tables)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[contexts * b:].any():
        raise CorruptFrame("context map's padding bits are not zero")
    return (bits[:contexts * b].reshape(contexts, b).astype(np.int64) << np.arange(b)).sum(axis=1).astype(np.uint8)


def chunk_raw_words(steps: int, raw_bits: int) -> int:
    """32-bit raw words of a chunk of ``steps`` steps: per group of STEPS_PER_GROUP steps, each
    lane's fields packed into as few words as hold them."""
    whole, rest = divmod(steps, STEPS_PER_GROUP)
    return LANES * (raw_bits * whole + (rest * raw_bits + 31) // 32)


def raw_length(numel: int, chunk: int, raw_bits: int) -> int:
    """Bytes of the raw stream."""
    n = num_chunks(numel, chunk)
    if not n or not raw_bits:
        return 0
    last = numel - (n - 1) * chunk
    return 4 * ((n - 1) * chunk_raw_words(chunk // LANES, raw_bits) + chunk_raw_words(-(-last // LANES), raw_bits))


def _pack_chunks(grid: np.ndarray, steps: int, raw_bits: int) -> np.ndarray:
    """Raw words (chunks, chunk_raw_words) of chunks whose fields are ``grid`` (chunks, steps, lane)."""
    parts = []
    for g in range(0, steps, STEPS_PER_GROUP):
        gl = min(STEPS_PER_GROUP, steps - g)
        words = np.zeros((grid.shape[0], (gl * raw_bits + 31) // 32, LANES), dtype=np.uint64)
        for s in range(gl):
            bit = raw_bits * s
            w, sh = bit >> 5, bit & 31
            f = grid[:, g + s].astype(np.uint64)
            words[:, w] |= (f << np.uint64(sh)) & np.uint64(0xFFFFFFFF)
            if sh + raw_bits > 32:
                words[:, w + 1] |= f >> np.uint64(32 - sh)
        parts.append(words.reshape(grid.shape[0], -1))
    return np.concatenate(parts, axis=1).astype(np.uint32)


def _unpack_chunks(words: np.ndarray, steps: int, raw_bits: int) -> np.ndarray:
    out = np.zeros((words.shape[0], steps, LANES), dtype=np.int64)
    at = 0
    mask = np.uint64((1 << raw_bits) - 1)
    for g in range(0, steps, STEPS_PER_GROUP):
        gl = min(STEPS_PER_GROUP, steps - g)
        nw = (gl * raw_bits + 31) // 32
        lane_words = words[:, at:at + nw * LANES].reshape(-1, nw, LANES).astype(np.uint64)
        at += nw * LANES
        for s in range(gl):
            bit = raw_bits * s
            w, sh = bit >> 5, bit & 31
            v = lane_words[:, w] >> np.uint64(sh)
            if sh + raw_bits > 32:
                v |= lane_words[:, w + 1] << np.uint64(32 - sh)
            out[:, g + s] = (v & mask).astype(np.int64)
    return out


def _raw_parts(numel: int, chunk: int) -> tuple[int, int, int]:
    """(full chunks, steps of a full chunk, steps of the last chunk)."""
    n = num_chunks(numel, chunk)
    return n - 1, chunk // LANES, -(-(numel - (n - 1) * chunk) // LANES)


def pack_raw(fields: np.ndarray, chunk: int, raw_bits: int) -> np.ndarray:
    """Stream 4: the raw fields (flat, one per element) as u32 words, per chunk and group of
    steps, lane k's words at 32 w + k."""
    numel = fields.size
    if not numel or not raw_bits:
        return np.zeros(0, dtype="<u4")
    full, steps, last_steps = _raw_parts(numel, chunk)
    grid = np.zeros(full * chunk + last_steps * LANES, dtype=np.int64)
    grid[:numel] = fields
    tail = _pack_chunks(grid[full * chunk:].reshape(1, last_steps, LANES), last_steps, raw_bits).reshape(-1)
    if full:
        head = _pack_chunks(grid[:full * chunk].reshape(full, steps, LANES), steps, raw_bits).reshape(-1)
        tail = np.concatenate([head, tail])
    return tail.astype("<u4")


def unpack_raw(words: np.ndarray, numel: int, chunk: int, raw_bits: int) -> np.ndarray:
    """Inverse of ``pack_raw`` (``words`` of ``raw_length`` bytes).

    Raises:
        CorruptFrame: a non-zero bit that belongs to no element.
    """
    full, steps, last_steps = _raw_parts(numel, chunk)
    split = full * chunk_raw_words(steps, raw_bits)
    fields = _unpack_chunks(words[split:].reshape(1, -1), last_steps, raw_bits).reshape(-1)
    if full:
        fields = np.concatenate([_unpack_chunks(words[:split].reshape(full, -1), steps, raw_bits).reshape(-1), fields])
    fields[numel:] = 0
    if not np.array_equal(pack_raw(fields[:numel], chunk, raw_bits), words):
        raise CorruptFrame("raw stream bits outside any element are not zero")
    return fields[:numel]


@dataclass(frozen=True)
class EntropyHeader:
    """A parsed, validated entropy frame header."""

    sym: SymbolLayout
    shape: tuple[int, ...]
    numel: int
    code_bits: int
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

    @property
    def element_geometry(self) -> Geometry:
        """The contexts this frame's elements reach: what its decoder builds tables for."""
        return self.geometry.for_elements(self.numel)

    def pack(self) -> bytes:
        flags = FLAG_STREAM_CRC if self.stream_crc is not None else 0
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        g = self.geometry
        body = _BODY.write(ENTROPY_VERSION, FRAME_ID, self.sym.layout.wire_id, len(self.shape),
                          self.code_bits, flags, self.tables, LANES, 0, self.chunk, g.outer, g.tokens, g.inner,
                          self.numel, *shape, *self.lengths, 0, self.stream_crc or 0)
        return body + _CRC.pack(crc32c(body))

    def with_crc(self, crc: int) -> EntropyHeader:
        return replace(self, stream_crc=crc)

    def with_words(self, words: int) -> EntropyHeader:
        """This header with ``words`` 32-bit code words (``make_header`` without its table walk)."""
        lengths = self.lengths[:Stream.WORDS] + (4 * words,) + self.lengths[Stream.WORDS + 1:]
        offsets, total = stream_offsets(lengths)
        return replace(self, lengths=lengths, offsets=offsets, total=total)


def make_header(sym: SymbolLayout, shape: tuple[int, ...], ct: CodeTables, chunk: int,
                words: int) -> EntropyHeader:
    """Header of a frame about to be written, ``words`` 32-bit code words in all."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    n = num_chunks(numel, chunk)
    lengths = (tables_length(ct), map_length(ct.geometry.contexts, ct.tables), 4 * n, 4 * words,
               raw_length(numel, chunk, sym.raw_bits))
    offsets, total = stream_offsets(lengths)
    return EntropyHeader(sym, tuple(shape), numel, CODE_BITS, ct.tables, chunk, ct.geometry,
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
    _, (dtype_id, ndim, code_bits, flags, tables, lanes, reserved, chunk,
        outer, tokens, inner, numel, *rest) = _BODY.read(body, version=ENTROPY_VERSION, codec_ids=(FRAME_ID,),
                                                           name="entropy")
    shape_all, lengths, reserved2, stream_crc = rest[:8], tuple(rest[8:13]), rest[13], rest[14]
    (header_crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if crc32c(body) != header_crc:
        raise CorruptFrame("header checksum mismatch")
    layout = layout_by_wire_id(dtype_id)
    if layout is None:
        raise CorruptFrame(f"unknown dtype id {dtype_id}")
    sym = symbol_layout(layout)
    if flags & ~FLAG_STREAM_CRC or reserved or reserved2 or (not flags & FLAG_STREAM_CRC and stream_crc):
        raise CorruptFrame(f"unknown flags or reserved bits {flags:#x}")
    if code_bits != CODE_BITS:
        raise CorruptFrame(f"codes of up to {code_bits} bits; this build reads {CODE_BITS}")
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
    fixed = (map_length(geometry.contexts, tables), 4 * n, raw_length(numel, chunk, sym.raw_bits))
    got = (lengths[Stream.MAP], lengths[Stream.COUNTS], lengths[Stream.RAW])
    if got != fixed:
        raise CorruptFrame(f"stream lengths {lengths} disagree with the header")
    # Every element takes a code of a bit or more (a stored chunk, S bits), so 32 at most a word.
    if lengths[Stream.WORDS] % 4 or lengths[Stream.WORDS] > 4 * caps_total or 8 * lengths[Stream.WORDS] < numel:
        raise CorruptFrame(f"word stream of {lengths[Stream.WORDS]} bytes for {numel} elements")
    per = _bitmap_bytes(sym)
    if not tables * per <= lengths[Stream.TABLES] <= tables * (per + (sym.alphabet + 1) // 2):
        raise CorruptFrame(f"table stream of {lengths[Stream.TABLES]} bytes for {tables} tables")
    offsets, total = stream_offsets(lengths)
    if frame_size != total:
        raise CorruptFrame(f"frame is {frame_size} bytes, header describes {total}")
    return EntropyHeader(sym, shape, numel, code_bits, tables, chunk, geometry, lengths, offsets, total,
                         stream_crc if flags & FLAG_STREAM_CRC else None)


def parse_tables(header: EntropyHeader, table_bytes: bytes, map_bytes: bytes) -> CodeTables:
    """The code tables a frame carries, checked completely (the decoder indexes with them), in
    the geometry its elements reach (``EntropyHeader.element_geometry``): what a decoder builds
    from them then costs at most what the frame's elements do, whatever period it names.

    Raises:
        CorruptFrame: malformed tables or map.
    """
    sym = header.sym
    per = _bitmap_bytes(sym)
    lengths = np.zeros((header.tables, sym.alphabet), dtype=np.int64)
    data = np.frombuffer(table_bytes, dtype=np.uint8)
    pos = 0
    for t in range(header.tables):
        if pos + per > data.size:
            raise CorruptFrame("table stream ends inside a table")
        present = np.unpackbits(data[pos:pos + per], bitorder="little").astype(bool)
        if present[sym.alphabet:].any():
            raise CorruptFrame(f"table {t} names a symbol past the alphabet")
        present = present[:sym.alphabet]
        k = int(present.sum())
        nbytes = (k + 1) // 2
        if pos + per + nbytes > data.size:
            raise CorruptFrame(f"table {t} has more symbols than the stream holds lengths for")
        nib = data[pos + per:pos + per + nbytes]
        both = np.stack([nib & 15, nib >> 4], axis=1).reshape(-1)
        if both[k:].any():
            raise CorruptFrame(f"table {t}: a padding nibble is not zero")
        lengths[t, present] = both[:k]
        pos += per + nbytes
    if pos != data.size:
        raise CorruptFrame("table stream has trailing bytes")
    problem = check_lengths(lengths, sym)
    cmap = unpack_map(map_bytes, header.geometry.contexts, header.tables)
    if problem is None and cmap.size and int(cmap.max()) >= header.tables:
        problem = "context map names a table that does not exist"
    if problem:
        raise CorruptFrame(f"frame's code tables: {problem}")
    geometry = header.element_geometry
    return CodeTables(sym, geometry, lengths, cmap[:geometry.contexts])


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
