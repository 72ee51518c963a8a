"""CPU reference of the entropy coder: it defines the frame's bytes (FORMAT.md, "entropy").

Canonical Huffman codes of at most ``CODE_BITS`` bits (``huffman.py``), ``LANES`` interleaved
bit streams per chunk: element ``k`` of a chunk belongs to lane ``k % 32`` at step ``k // 32``.
Each lane's stream is MSB first: its codes in step order, and after a segment's codes the raw
bits of the symbols it escaped in that segment. Steps run in groups of ``STEPS_PER_GROUP``, and a
group in segments of ``SEGMENT`` steps (the last one shorter); the chunk's last group may be
short too.

The words of a chunk's lanes are interleaved in the order a warp takes them. At a *refill point*
every lane whose window holds fewer than ``need`` unread bits takes the chunk's next word (lanes
in order) and gains 32 bits; a lane's ``j``-th word is bits ``[32 j, 32 j + 32)`` of its stream,
zero past its end. There is a refill point before every segment (``need`` = CODE_BITS per step of
the segment) and, where any lane escaped in the segment, one after its codes (``need`` =
sym_bits per step of the segment), before the escaped bits. So a window never runs dry and never
needs more than one word at a time: a decoder reads the next ``CODE_BITS`` bits, looks the code
up, and shifts. In a chunk's last group ``need`` is exact instead: the bits the lane's codes (or
escaped bits) up to the next refill point take, which a decoder learns by decoding them from its
window first; so a lane ends its chunk with less than a word of padding, where the worst case
would leave it about one. A chunk that coding would not shrink (as many words as its symbols'
packed size, or more) is stored: its symbols packed raw.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import bitpack
from ..errors import CorruptFrame
from . import huffman
from .format import LANES, SEGMENT, STEPS_PER_GROUP, chunk_caps, num_chunks
from .huffman import CODE_BITS, LEN_BITS, CodeTables
from .symbols import SymbolLayout


def _grid(values: np.ndarray, nchunks: int, chunk: int, fill: int = 0) -> np.ndarray:
    """Flat per-element values as (chunk, step, lane), padded with ``fill`` past the end."""
    out = np.full(nchunks * chunk, fill, dtype=values.dtype)
    out[:values.size] = values
    return out.reshape(nchunks, chunk // LANES, LANES)


def element_tables(ct: CodeTables, start: int, n: int) -> np.ndarray:
    """Table of elements ``start .. start+n-1`` (int64)."""
    return ct.context_map[ct.geometry.context_of(start, n)].astype(np.int64)


def segments(steps: int) -> list[tuple[int, int]]:
    """The segments ``[a, b)`` of a chunk of ``steps`` steps, in order."""
    out = []
    for g in range(0, steps, STEPS_PER_GROUP):
        end = min(g + STEPS_PER_GROUP, steps)
        out += [(a, min(a + SEGMENT, end)) for a in range(g, end, SEGMENT)]
    return out


def pack_symbols(symbols: np.ndarray, sym: SymbolLayout, cap: int) -> np.ndarray:
    """A stored chunk's words: its symbols as an LSB-first bit stream of ``sym_bits`` fields,
    zero-padded to ``cap`` 32-bit words."""
    packed = bitpack.pack(torch.from_numpy(symbols.astype(np.int32)), sym.sym_bits).numpy()
    out = np.zeros(4 * cap, dtype=np.uint8)
    out[:packed.size] = packed
    return out.view("<u4")


def unpack_symbols(words: np.ndarray, n: int, sym: SymbolLayout) -> np.ndarray:
    return bitpack.unpack(torch.from_numpy(words.view(np.uint8).copy()), n, sym.sym_bits).numpy().astype(np.int64)


class _Schedule:
    """The refill points and segments of every chunk at once: chunks differ only in how many
    steps they have (the last may have fewer)."""

    def __init__(self, n: int, chunk: int):
        self.nchunks = num_chunks(n, chunk)
        self.steps = chunk // LANES
        here = np.minimum(chunk, n - np.arange(self.nchunks, dtype=np.int64) * chunk)
        self.chunk_steps = (here + LANES - 1) // LANES

    def active(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunks that have segment ``[a, b)``, how many of its steps each has, and whether it
        lies in the chunk's last group (exact refills)."""
        have = np.clip(self.chunk_steps - a, 0, b - a)
        exact = a // STEPS_PER_GROUP == (self.chunk_steps - 1) // STEPS_PER_GROUP
        return have > 0, have, exact


def encode_symbols(symbols: np.ndarray, ct: CodeTables, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Code ``symbols`` (flat, int64, each < 2**sym_bits): (word counts u32 per chunk, words u32).
    A chunk that would take as many words as its cap or more is stored instead: count = cap,
    its symbols packed."""
    sym: SymbolLayout = ct.sym
    n = symbols.size
    plan = _Schedule(n, chunk)
    nchunks, steps = plan.nchunks, plan.steps
    lengths, codes = ct.lengths, ct.codes
    table = element_tables(ct, 0, n)
    length = lengths[table, symbols]
    esc = length == 0
    code = np.where(esc, codes[table, sym.esc], codes[table, symbols])
    length = np.where(esc, lengths[table, sym.esc], length)
    code_g = _grid(code, nchunks, chunk)
    len_g = _grid(length, nchunks, chunk)
    esc_g = _grid(esc, nchunks, chunk, False)
    raw_g = _grid(symbols, nchunks, chunk)
    max_words = steps * (CODE_BITS + sym.sym_bits) // 32 + 4
    lane_words = np.zeros((nchunks, LANES, max_words), dtype=np.uint64)
    written = np.zeros((nchunks, LANES), dtype=np.int64)  # bits of each lane's stream so far
    window = np.zeros((nchunks, LANES), dtype=np.int64)  # a decoder's unread bits
    taken = np.zeros((nchunks, LANES), dtype=np.int64)
    order: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (chunks, lanes, word index) per point
    rows = np.arange(nchunks)[:, None]
    lanes = np.arange(LANES)[None, :]

    def refill(chunks: np.ndarray, need: np.ndarray) -> None:
        """``need``: bits per (chunk, lane)."""
        take = chunks[:, None] & (window < need)
        c, k = np.nonzero(take)  # chunk-major, lanes in order
        order.append((c, k, taken[c, k].copy()))
        taken[take] += 1
        window[take] += 32

    def append(value: np.ndarray, bits: np.ndarray) -> None:
        at, shift = written >> 5, written & 31
        spill = np.maximum(shift + bits - 32, 0)
        first = (value >> spill) << np.maximum(32 - shift - bits, 0)
        second = np.where(spill > 0, (value & ((1 << spill) - 1)) << (32 - spill), 0)
        lane_words[rows, lanes, at] |= first.astype(np.uint64)
        lane_words[rows, lanes, at + 1] |= second.astype(np.uint64)
        written[...] += bits
        window[...] -= bits

    for a, b in segments(steps):
        chunks, have, exact = plan.active(a, b)
        exact = exact[:, None]
        refill(chunks, np.where(exact, len_g[:, a:b].sum(axis=1), CODE_BITS * have[:, None]))
        for s in range(a, b):
            append(code_g[:, s], len_g[:, s])
        escaped = esc_g[:, a:b]
        if escaped.any():
            chunks = escaped.any(axis=(1, 2))
            refill(chunks, np.where(exact, sym.sym_bits * escaped.sum(axis=1), sym.sym_bits * have[:, None]))
            for s in range(a, b):
                e = escaped[:, s - a]
                append(np.where(e, raw_g[:, s], 0), np.where(e, sym.sym_bits, 0))
    counts = taken.sum(axis=1)
    caps = chunk_caps(n, chunk, sym)
    stored = counts >= caps
    c = np.concatenate([o[0] for o in order])
    k = np.concatenate([o[1] for o in order])
    j = np.concatenate([o[2] for o in order])
    by_chunk = np.argsort(c, kind="stable")
    words = lane_words[c[by_chunk], k[by_chunk], j[by_chunk]].astype(np.uint32)
    if stored.any():
        pieces = np.split(words, np.cumsum(counts)[:-1])
        for ci in np.flatnonzero(stored):
            pieces[ci] = pack_symbols(symbols[ci * chunk:(ci + 1) * chunk], sym, int(caps[ci]))
        words = np.concatenate(pieces)
        counts = np.where(stored, caps, counts)
    return counts.astype("<u4"), words.astype("<u4")


def decode_symbols(counts: np.ndarray, starts: np.ndarray, words: np.ndarray, ct: CodeTables, n: int,
                   chunk: int) -> np.ndarray:
    """Inverse of ``encode_symbols``: the ``n`` symbols (int64), every step checked.

    Raises:
        CorruptFrame: bits that start no code, a chunk reading past its words or leaving some
            unread, non-zero bits after a lane's last code, or a non-canonical escape.
    """
    sym = ct.sym
    plan = _Schedule(n, chunk)
    nchunks, steps = plan.nchunks, plan.steps
    stored = counts.astype(np.int64) == chunk_caps(n, chunk, sym)
    lengths = ct.lengths
    lut = huffman.decode_lut(ct).astype(np.int64)
    table_g = _grid(element_tables(ct, 0, n), nchunks, chunk)
    valid = _grid(np.ones(n, dtype=bool), nchunks, chunk, False)
    valid[stored] = False
    live = ~stored
    window = np.zeros((nchunks, LANES), dtype=np.uint64)  # unread bits at the top
    fill = np.zeros((nchunks, LANES), dtype=np.int64)  # how many
    ptr = np.where(stored, starts[1:], starts[:-1])
    end = starts[1:]
    padded = np.zeros(words.size + 1, dtype=np.uint64)  # a read past the end finds 0, then fails
    padded[:words.size] = words
    out = np.zeros((nchunks, steps, LANES), dtype=np.int64)
    low = np.uint64((1 << CODE_BITS) - 1)

    def refill(chunks: np.ndarray, need: np.ndarray) -> None:
        nonlocal ptr
        take = (chunks & live)[:, None] & (fill < need)
        rank = np.cumsum(take, axis=1) - take
        taken = take.sum(axis=1)
        if (ptr + taken > end).any():
            raise CorruptFrame("a chunk reads past its words")
        w = padded[np.where(take, ptr[:, None] + rank, padded.size - 1)]
        shift = (32 - fill).astype(np.uint64)
        window[...] = np.where(take, window | (w << shift), window)
        fill[...] += 32 * take
        ptr = ptr + taken

    def consume(bits: np.ndarray) -> np.ndarray:
        """The next ``bits`` bits of every lane (0 where bits is 0), removed from the window."""
        b = bits.astype(np.uint64)
        value = np.where(bits > 0, window >> (np.uint64(64) - b) % np.uint64(64), 0)
        window[...] = np.where(bits > 0, window << b, window)
        fill[...] -= bits
        return value.astype(np.int64)

    def tentative(a: int, b: int) -> np.ndarray:
        """Bits each lane's codes of steps a..b-1 take, decoded from its window (past its
        unread bits the window is zero, so a code that does not fit reads as longer than them;
        bits that start no code count as not fitting)."""
        used = np.zeros((nchunks, LANES), dtype=np.int64)
        for s in range(a, b):
            peek = np.where(used < 64, window << np.minimum(used, 63).astype(np.uint64), 0)
            e = lut[table_g[:, s], ((peek >> np.uint64(64 - CODE_BITS)) & low).astype(np.int64)]
            used += np.where(valid[:, s], np.where(e == 0, 64, e & ((1 << LEN_BITS) - 1)), 0)
        return used

    # Steps past every chunk's last hold no element: walking them would cost a frame of few
    # elements as much as a chunk of its nominal size.
    for a, b in segments(int(plan.chunk_steps.max(initial=0))):
        chunks, have, exact = plan.active(a, b)
        need = np.broadcast_to(CODE_BITS * have[:, None], (nchunks, LANES))
        if exact.any():
            need = np.where(exact[:, None], tentative(a, b), need)
        refill(chunks, need)
        for s in range(a, b):
            v, t = valid[:, s], table_g[:, s]
            e = lut[t, ((window >> np.uint64(64 - CODE_BITS)) & low).astype(np.int64)]
            if (v & (e == 0)).any():
                raise CorruptFrame("bits that start no code of their table")
            e = np.where(v, e, 0)
            consume(e & ((1 << LEN_BITS) - 1))
            out[:, s] = e >> LEN_BITS
        escaped = valid[:, a:b] & (out[:, a:b] == sym.esc)
        if escaped.any():
            refill(escaped.any(axis=(1, 2)), np.where(exact[:, None], sym.sym_bits * escaped.sum(axis=1),
                                                      sym.sym_bits * have[:, None]))
            for s in range(a, b):
                e = escaped[:, s - a]
                raw = consume(np.where(e, sym.sym_bits, 0))
                if (e & (lengths[table_g[:, s], raw] != 0)).any():
                    raise CorruptFrame("an escape codes a symbol its table has")
                out[:, s] = np.where(e, raw, out[:, s])
    if (ptr != end).any() or (window[live] != 0).any():
        raise CorruptFrame("coded streams do not decode to their end (corrupt words)")
    for c in np.flatnonzero(stored):
        span = min(chunk, n - c * chunk)
        out[c].reshape(-1)[:span] = unpack_symbols(words[starts[c]:starts[c + 1]], span, sym)
    return out.reshape(-1)[:n]
