"""CPU reference of the entropy coder: it defines the frame's bytes (FORMAT.md, "entropy").

Static rANS with 32-bit states and 16-bit words, ``LANES`` interleaved states per chunk: element
``k`` of a chunk belongs to lane ``k % 32`` at step ``k // 32``. A decoder step decodes one
symbol per lane and then, lanes in order, refills each lane whose state fell below 2**16 with
the chunk's next word; escaped lanes then take their symbol's raw bits from the state, refilled
the same way. That order is what a warp does with one ballot per refill, and it is why the
encoder can be written as here: every lane of every chunk advances together, numpy vectorized
over lanes (a chunk's steps are the only loop), the words landing in a (chunk, step, phase,
lane) array whose used entries, in order, are the word stream. A chunk that coding would not
shrink (as many words as its symbols' raw size, or more) is stored: its symbols packed raw.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import bitpack
from ..errors import CorruptFrame
from .codebook import EntropyCodebook
from .format import LANES, STATE_LOW, chunk_caps, num_chunks
from .symbols import SymbolLayout

_MASK16 = np.uint64(0xFFFF)


def _grid(values: np.ndarray, nchunks: int, chunk: int, fill: int = 0) -> np.ndarray:
    """Flat per-element values as (chunk, step, lane), padded with ``fill`` past the end."""
    out = np.full(nchunks * chunk, fill, dtype=values.dtype)
    out[:values.size] = values
    return out.reshape(nchunks, chunk // LANES, LANES)


def element_tables(book: EntropyCodebook, start: int, n: int) -> np.ndarray:
    """Table of elements ``start .. start+n-1`` (int64)."""
    return book.context_map[book.geometry.context_of(start, n)].astype(np.int64)


def pack_symbols(symbols: np.ndarray, sym: SymbolLayout, cap: int) -> np.ndarray:
    """A stored chunk's words: its symbols as an LSB-first bit stream of ``sym_bits`` fields,
    zero-padded to ``cap`` 16-bit words."""
    packed = bitpack.pack(torch.from_numpy(symbols.astype(np.int32)), sym.sym_bits).numpy()
    out = np.zeros(2 * cap, dtype=np.uint8)
    out[:packed.size] = packed
    return out.view("<u2")


def unpack_symbols(words: np.ndarray, n: int, sym: SymbolLayout) -> np.ndarray:
    return bitpack.unpack(torch.from_numpy(words.view(np.uint8).copy()), n, sym.sym_bits).numpy().astype(np.int64)


def encode_symbols(symbols: np.ndarray, book: EntropyCodebook, chunk: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rANS-code ``symbols`` (flat, int64, each < 2**sym_bits): (word counts u32 per chunk,
    final states u32 (chunk, lane), words u16). A chunk that would take as many words as its
    cap or more is stored instead: count = cap, states 0, its symbols packed."""
    sym: SymbolLayout = book.symbols
    n = symbols.size
    nchunks = num_chunks(n, chunk)
    M = book.prob_bits
    table = element_tables(book, 0, n)
    freq = book.freqs[table, symbols].astype(np.int64)
    esc = freq == 0
    coded = np.where(esc, sym.esc, symbols)
    freq = book.freqs[table, coded].astype(np.uint64)
    cum = book.cumulative()[table, coded].astype(np.uint64)
    valid = _grid(np.ones(n, dtype=bool), nchunks, chunk, False)
    esc_g = _grid(esc, nchunks, chunk, False)
    raw_g = _grid(symbols.astype(np.uint64), nchunks, chunk)
    freq_g = _grid(freq, nchunks, chunk, 1)
    cum_g = _grid(cum, nchunks, chunk)
    bound_g = freq_g << np.uint64(32 - M)
    esc_bound = np.uint64(1 << (32 - sym.sym_bits))
    steps = chunk // LANES
    words = np.zeros((nchunks, steps, 2, LANES), dtype=np.uint16)
    emitted = np.zeros((nchunks, steps, 2, LANES), dtype=bool)
    x = np.full((nchunks, LANES), STATE_LOW, dtype=np.uint64)
    b, m = np.uint64(sym.sym_bits), np.uint64(M)
    s16 = np.uint64(16)
    for s in range(steps - 1, -1, -1):
        e = esc_g[:, s]
        if e.any():  # phase 2 (decoded last, so coded first): the raw symbol bits
            out = e & (x >= esc_bound)
            words[:, s, 1] = x & _MASK16
            emitted[:, s, 1] = out
            x = np.where(out, x >> s16, x)
            x = np.where(e, (x << b) + raw_g[:, s], x)
        v, f = valid[:, s], freq_g[:, s]
        out = v & (x >= bound_g[:, s])
        words[:, s, 0] = x & _MASK16
        emitted[:, s, 0] = out
        x = np.where(out, x >> s16, x)
        x = np.where(v, ((x // f) << m) + x % f + cum_g[:, s], x)
    counts = emitted.sum(axis=(1, 2, 3))
    caps = chunk_caps(n, chunk, sym)
    stored = counts >= caps
    coded_words = words[emitted]
    if stored.any():
        pieces = np.split(coded_words, np.cumsum(counts)[:-1])
        for c in np.flatnonzero(stored):
            pieces[c] = pack_symbols(symbols[c * chunk:(c + 1) * chunk], sym, int(caps[c]))
        coded_words = np.concatenate(pieces)
        counts = np.where(stored, caps, counts)
        x[stored] = 0
    return counts.astype("<u4"), x.astype("<u4"), coded_words.astype("<u2")


def decode_symbols(counts: np.ndarray, starts: np.ndarray, states: np.ndarray, words: np.ndarray,
                   book: EntropyCodebook, n: int, chunk: int) -> np.ndarray:
    """Inverse of ``encode_symbols``: the ``n`` symbols (int64), every step checked.

    Raises:
        CorruptFrame: a state out of range, a chunk reading past its words or leaving some
            unread, a lane not ending in the initial state, or a non-canonical escape.
    """
    sym = book.symbols
    nchunks = num_chunks(n, chunk)
    M = book.prob_bits
    x = states.reshape(nchunks, LANES).astype(np.uint64)
    stored = counts.astype(np.int64) == chunk_caps(n, chunk, sym)
    if (x[stored] != 0).any():
        raise CorruptFrame("a stored chunk has coder states")
    x[stored] = STATE_LOW  # no steps: it ends where it starts
    if ((x < STATE_LOW) | (x >= 1 << 32)).any():
        raise CorruptFrame("a coder state is out of range")
    table_g = _grid(element_tables(book, 0, n), nchunks, chunk)
    valid = _grid(np.ones(n, dtype=bool), nchunks, chunk, False)
    valid[stored] = False
    slot_sym = book.slot_symbols()
    freqs = book.freqs.astype(np.uint64)
    cums = book.cumulative().astype(np.uint64)
    ptr = np.where(stored, starts[1:], starts[:-1])
    end = starts[1:]
    padded = np.zeros(words.size + 1, dtype=np.uint64)  # a read past the end finds 0, then fails the check
    padded[:words.size] = words
    steps = chunk // LANES
    out = np.zeros((nchunks, steps, LANES), dtype=np.int64)
    slot_mask, m, b = np.uint64((1 << M) - 1), np.uint64(M), sym.sym_bits
    low = np.uint64(STATE_LOW)
    raw_mask = np.uint64((1 << b) - 1)
    rows = np.arange(nchunks)[:, None]
    for s in range(steps):
        v, t = valid[:, s], table_g[:, s]
        slot = (x & slot_mask).astype(np.int64)
        symbol = slot_sym[t, slot].astype(np.int64)
        f, c = freqs[t, symbol], cums[t, symbol]
        x = np.where(v, f * (x >> m) + slot.astype(np.uint64) - c, x)
        x, ptr = _refill(x, v & (x < low), ptr, end, padded)
        e = v & (symbol == sym.esc)
        if e.any():
            raw = (x & raw_mask).astype(np.int64)
            if (e & (book.freqs[t, np.minimum(raw, sym.esc)] != 0)).any():
                raise CorruptFrame("an escape codes a symbol its table has")
            symbol = np.where(e, raw, symbol)
            x = np.where(e, x >> np.uint64(b), x)
            x, ptr = _refill(x, e & (x < low), ptr, end, padded)
        out[:, s] = symbol
    if (ptr != end).any() or (x != STATE_LOW).any():
        raise CorruptFrame("coded streams do not decode to their end (corrupt words or states)")
    del rows
    for c in np.flatnonzero(stored):
        span = min(chunk, n - c * chunk)
        out[c].reshape(-1)[:span] = unpack_symbols(words[starts[c]:starts[c + 1]], span, sym)
    return out.reshape(-1)[:n]


def _refill(x: np.ndarray, need: np.ndarray, ptr: np.ndarray, end: np.ndarray, padded: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Each needy lane, in lane order, takes its chunk's next word."""
    if not need.any():
        return x, ptr
    rank = np.cumsum(need, axis=1) - need
    idx = ptr[:, None] + rank
    taken = need.sum(axis=1)
    if (ptr + taken > end).any():
        raise CorruptFrame("a chunk reads past its words")
    w = padded[np.where(need, idx, padded.size - 1)]
    return np.where(need, (x << np.uint64(16)) | w, x), ptr + taken
