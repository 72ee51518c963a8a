"""Canonical, length-limited Huffman codes derived from a codebook's frequency tables.

A codebook holds frequencies; the encoder derives code lengths from them here and a frame
carries the lengths, from which both ends build the same canonical codes. Codes are part of
the format: change nothing here without a new entropy format version. Codes are at most ``CODE_BITS`` long, so a decoder finds any code with
one lookup of the stream's next ``CODE_BITS`` bits, and a table's lookup fits in 2 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CodebookMismatch
from .symbols import Geometry, SymbolLayout

if TYPE_CHECKING:  # the codebook imports this module (its code lengths): only a type here
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
        raise CodebookMismatch(f"{symbols.size} symbols do not fit codes of {limit} bits")
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


@dataclass(frozen=True, eq=False)
class CodeTables:
    """The codes a frame is written with: each table's code lengths (0: the table lacks the
    symbol, which is then escaped) and the context map that picks a table per position."""

    sym: SymbolLayout
    geometry: Geometry
    lengths: np.ndarray  # (tables, alphabet) int64, ESC last
    context_map: np.ndarray  # (contexts,) uint8
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def tables(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def codes(self) -> np.ndarray:
        if "codes" not in self._cache:
            self._cache["codes"] = np.stack([canonical_codes(row) for row in self.lengths])
        return self._cache["codes"]


def check_lengths(lengths: np.ndarray, sym: SymbolLayout) -> str | None:
    """Why ``lengths`` are not a frame's code tables, or None: every table has the escape, no
    code is longer than CODE_BITS, and the codes are complete (Kraft sum 1; a lone symbol: 1 bit)."""
    if lengths.ndim != 2 or lengths.shape[1] != sym.alphabet:
        return f"code tables must be rows of {sym.alphabet} lengths"
    if ((lengths < 0) | (lengths > CODE_BITS)).any():
        return f"a code is longer than {CODE_BITS} bits"
    if (lengths[:, sym.esc] == 0).any():
        return "every table needs the escape symbol"
    for t, row in enumerate(lengths):
        used = row[row > 0]
        kraft = int((np.int64(1) << (CODE_BITS - used)).sum())
        if kraft != 1 << CODE_BITS and not (used.size == 1 and used[0] == 1):
            return f"table {t}'s codes are not complete"
    return None


def code_tables(book: EntropyCodebook) -> CodeTables:
    """The codes ``book``'s frequencies give (cached on the book)."""
    if "code_tables" not in book._cache:
        lengths = np.stack([code_lengths(row) for row in book.freqs])
        book._cache["code_tables"] = CodeTables(book.symbols, book.geometry, lengths, book.context_map)
    return book._cache["code_tables"]


def decode_lut(ct: CodeTables) -> np.ndarray:
    """(tables, 2**CODE_BITS) uint16: for each table and each value of the stream's next
    CODE_BITS bits, symbol << LEN_BITS | length of the code they start with; 0 where they start
    no code (a lone symbol's table: a corrupt stream)."""
    if "lut" not in ct._cache:
        lengths, codes = ct.lengths, ct.codes
        lut = np.zeros((lengths.shape[0], 1 << CODE_BITS), dtype=np.uint16)
        for t in range(lengths.shape[0]):
            for s in np.flatnonzero(lengths[t]):
                n = int(lengths[t, s])
                first = int(codes[t, s]) << (CODE_BITS - n)
                lut[t, first:first + (1 << (CODE_BITS - n))] = s << LEN_BITS | n
        ct._cache["lut"] = lut
    return ct._cache["lut"]


def encode_table(ct: CodeTables) -> np.ndarray:
    """(tables, 2**sym_bits) uint32: code | length << 16 of each symbol; for a symbol its table
    lacks, the escape's code and length with ESC_FLAG (its own bits follow later)."""
    if "enc" not in ct._cache:
        esc = ct.sym.esc
        entry = ct.codes | ct.lengths << 16
        table = np.where(ct.lengths[:, :esc] > 0, entry[:, :esc], entry[:, esc:esc + 1] | ESC_FLAG)
        ct._cache["enc"] = table.astype(np.uint32)
    return ct._cache["enc"]
