"""Canonical, length-limited Huffman codes derived from a codebook's frequency tables.

A frame carries frequencies (the codebook's tables); both ends derive the same codes from them
with this module, so the codes are part of the format: change nothing here without a new
entropy format version. Codes are at most ``CODE_BITS`` long, so a decoder finds any code with
one lookup of the stream's next ``CODE_BITS`` bits, and a table's lookup fits in 2 KiB.
"""

from __future__ import annotations

import numpy as np

from .codebook import EntropyCodebook

CODE_BITS = 10  # longest code: one lookup of 2**10 entries decodes any symbol
LEN_BITS = 4  # a lookup entry is symbol << LEN_BITS | length
ESC_FLAG = 1 << 31  # an encode-table entry that is the escape's code (the table lacks the symbol)


def code_lengths(freqs: np.ndarray, limit: int = CODE_BITS) -> np.ndarray:
    """Optimal code lengths of at most ``limit`` bits (package-merge) for every symbol with a
    non-zero frequency, 0 for the others; a single symbol gets length 1.

    Items are ordered by weight, ties by kind (a symbol before a package) and then by position,
    so every build derives the same lengths.
    """
    freqs = np.asarray(freqs, dtype=np.int64)
    symbols = np.flatnonzero(freqs > 0)
    lengths = np.zeros(freqs.size, dtype=np.int64)
    if symbols.size <= 1:
        lengths[symbols] = 1
        return lengths
    if symbols.size > 1 << limit:
        raise ValueError(f"{symbols.size} symbols do not fit codes of {limit} bits")
    n = symbols.size
    order = np.lexsort((symbols, freqs[symbols]))
    leaf_w = freqs[symbols][order]
    leaf_m = np.eye(n, dtype=np.int16)[order]  # which symbols an item holds, once each
    weights, members = leaf_w, leaf_m
    for _ in range(limit - 1):
        pairs = weights.size // 2
        pack_w = weights[0:2 * pairs:2] + weights[1:2 * pairs:2]
        pack_m = members[0:2 * pairs:2] + members[1:2 * pairs:2]
        w = np.concatenate([leaf_w, pack_w])
        kind = np.concatenate([np.zeros(n, dtype=np.int64), np.ones(pairs, dtype=np.int64)])
        pos = np.concatenate([np.arange(n), np.arange(pairs)])
        merged = np.lexsort((pos, kind, w))
        weights, members = w[merged], np.concatenate([leaf_m, pack_m])[merged]
    lengths[symbols] = members[:2 * n - 2].sum(axis=0, dtype=np.int64)
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes (MSB first) for ``lengths``: by length, then by symbol."""
    codes = np.zeros(lengths.size, dtype=np.int64)
    code, prev = 0, 0
    for s in np.lexsort((np.arange(lengths.size), lengths)):
        n = int(lengths[s])
        if n == 0:
            continue
        code <<= n - prev
        codes[s] = code
        code += 1
        prev = n
    return codes


def tables_of(book: EntropyCodebook) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, codes) of every table, (tables, alphabet) int64 each; cached on the book."""
    if "huffman" not in book._cache:
        lengths = np.stack([code_lengths(row) for row in book.freqs])
        codes = np.stack([canonical_codes(row) for row in lengths])
        book._cache["huffman"] = (lengths, codes)
    return book._cache["huffman"]


def decode_lut(book: EntropyCodebook) -> np.ndarray:
    """(tables, 2**CODE_BITS) uint16: for each table and each value of the stream's next
    CODE_BITS bits, symbol << LEN_BITS | length of the code they start with; 0 where they start
    no code (an incomplete code's gap: a corrupt stream)."""
    if "lut" not in book._cache:
        lengths, codes = tables_of(book)
        lut = np.zeros((lengths.shape[0], 1 << CODE_BITS), dtype=np.uint16)
        for t in range(lengths.shape[0]):
            for s in np.flatnonzero(lengths[t]):
                n = int(lengths[t, s])
                first = int(codes[t, s]) << (CODE_BITS - n)
                lut[t, first:first + (1 << (CODE_BITS - n))] = s << LEN_BITS | n
        book._cache["lut"] = lut
    return book._cache["lut"]


def encode_table(book: EntropyCodebook) -> np.ndarray:
    """(tables, 2**sym_bits) uint32: code | length << 16 of each symbol; for a symbol its table
    lacks, the escape's code and length with ESC_FLAG (its own bits follow later)."""
    if "enc" not in book._cache:
        esc = book.symbols.esc
        lengths, codes = tables_of(book)
        entry = codes | lengths << 16
        table = np.where(lengths[:, :esc] > 0, entry[:, :esc], entry[:, esc:esc + 1] | ESC_FLAG)
        book._cache["enc"] = table.astype(np.uint32)
    return book._cache["enc"]
