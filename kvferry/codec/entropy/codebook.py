"""Entropy codebooks: static tables of symbol frequencies and the context map that picks one.

Calibration counts symbols per context (a position within a block, the token axis folded
away), clusters the contexts into at most ``tables`` tables by the code length they would cost
(Lloyd iterations with cross-entropy as the distance), and quantizes each table to
frequencies summing to ``2**prob_bits``. Fewer tables than contexts is the point: a table per
context overfits one calibration chunk, while 8-32 clustered tables carry almost all the gain
and fit a GPU's shared memory. Everything is deterministic: no random initialization, ties
broken by index.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dtypes import layout_for
from ..errors import CodebookMismatch, UnsupportedTensor
from .symbols import Geometry, SymbolLayout, element_bits, for_name

FORMAT_NAME = "kvferry-entropy-codebook"
CODEBOOK_VERSION = 1
DEFAULT_TABLES = 32
DEFAULT_PROB_BITS = 11
MAX_TABLES = 255
MAX_CONTEXTS = 1 << 16
MIN_PROB_BITS, MAX_PROB_BITS = 10, 14
_LLOYD_ROUNDS = 25
_REFINE_ROUNDS = 4


@dataclass(frozen=True, eq=False)
class EntropyCodebook:
    """Tables (``freqs[t, s]``: frequency of symbol s in table t, ESC last, each row summing to
    ``2**prob_bits``, ESC >= 1) and the context map (table of each context of ``geometry``)."""

    dtype: str
    prob_bits: int
    geometry: Geometry
    freqs: np.ndarray  # (tables, alphabet) int32
    context_map: np.ndarray  # (contexts,) uint8
    samples: int = 0
    bits_per_symbol: float = 0.0  # calibration's own estimate, informational
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            sym = self.symbols
        except UnsupportedTensor as exc:
            raise CodebookMismatch(str(exc)) from exc
        problem = check_tables(self.freqs, self.context_map, self.prob_bits, sym, self.geometry)
        if problem:
            raise CodebookMismatch(problem)

    @property
    def symbols(self) -> SymbolLayout:
        return for_name(self.dtype)

    @property
    def tables(self) -> int:
        return int(self.freqs.shape[0])

    def to_json(self) -> str:
        g = self.geometry
        return json.dumps({
            "format": FORMAT_NAME, "version": CODEBOOK_VERSION, "dtype": self.dtype,
            "prob_bits": self.prob_bits, "geometry": {"outer": g.outer, "tokens": g.tokens, "inner": g.inner},
            "tables": [{"symbols": np.flatnonzero(row).tolist(), "freqs": row[row > 0].tolist()}
                       for row in self.freqs],
            "context_map": base64.b64encode(self.context_map.astype(np.uint8).tobytes()).decode(),
            "samples": self.samples, "bits_per_symbol": self.bits_per_symbol,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> EntropyCodebook:
        """Parse ``to_json`` output.

        Raises:
            CodebookMismatch: not an entropy codebook of this version, or invalid contents.
        """
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
                raise CodebookMismatch(f"not a {FORMAT_NAME} document")
            if doc.get("version") != CODEBOOK_VERSION:
                raise CodebookMismatch(f"entropy codebook version {doc.get('version')!r}, "
                                       f"this build reads {CODEBOOK_VERSION}")
            sym = for_name(str(doc["dtype"]))
            g = doc["geometry"]
            geometry = Geometry(int(g["outer"]), int(g["tokens"]), int(g["inner"]))
            tables = doc["tables"]
            if not isinstance(tables, list) or not 1 <= len(tables) <= MAX_TABLES:
                raise CodebookMismatch(f"a codebook has 1..{MAX_TABLES} tables")
            freqs = np.zeros((len(tables), sym.alphabet), dtype=np.int32)
            for t, table in enumerate(tables):
                symbols = [int(s) for s in table["symbols"]]
                counts = [int(f) for f in table["freqs"]]
                if len(symbols) != len(counts) or any(not 0 <= s < sym.alphabet for s in symbols) \
                        or any(f <= 0 for f in counts) or len(set(symbols)) != len(symbols):
                    raise CodebookMismatch(f"table {t} is malformed")
                freqs[t, symbols] = counts
            cmap = np.frombuffer(base64.b64decode(doc["context_map"], validate=True), dtype=np.uint8).copy()
            return cls(sym.layout.name, int(doc["prob_bits"]), geometry, freqs, cmap,
                       int(doc.get("samples", 0)), float(doc.get("bits_per_symbol", 0.0)))
        except CodebookMismatch:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, UnsupportedTensor) as exc:
            raise CodebookMismatch(f"malformed entropy codebook JSON: {exc}") from exc


def check_tables(freqs: np.ndarray, cmap: np.ndarray, prob_bits: int, sym: SymbolLayout,
                 geometry: Geometry) -> str | None:
    """Why these tables and map are not a valid codebook, or None (codebook and frame share it)."""
    if not MIN_PROB_BITS <= prob_bits <= MAX_PROB_BITS:
        return f"prob_bits {prob_bits} is outside {MIN_PROB_BITS}..{MAX_PROB_BITS}"
    if min(geometry.outer, geometry.tokens, geometry.inner) < 1 or geometry.contexts > MAX_CONTEXTS \
            or geometry.period >= 1 << 48:
        return f"bad geometry {geometry} (1..{MAX_CONTEXTS} contexts)"
    if freqs.ndim != 2 or freqs.shape[1] != sym.alphabet or not 1 <= freqs.shape[0] <= MAX_TABLES:
        return f"tables must be 1..{MAX_TABLES} rows of {sym.alphabet} frequencies"
    if (freqs < 0).any() or (freqs.sum(axis=1) != 1 << prob_bits).any():
        return f"every table's frequencies must sum to 2**{prob_bits}"
    if (freqs[:, sym.esc] < 1).any():
        return "every table needs the escape symbol"
    if cmap.ndim != 1 or cmap.size != geometry.contexts:
        return f"context map has {cmap.size} entries, geometry has {geometry.contexts} contexts"
    if cmap.size and int(cmap.max()) >= freqs.shape[0]:
        return "context map names a table that does not exist"
    return None


def _samples_of(samples: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    items = [samples] if isinstance(samples, torch.Tensor) else list(samples)
    if not items:
        raise CodebookMismatch("calibration needs at least one tensor")
    layout = layout_for(items[0].dtype)
    for t in items:
        if layout_for(t.dtype) is not layout:
            raise CodebookMismatch(f"calibration mixes {layout.name} and {t.dtype}")
        if tuple(t.shape) != tuple(items[0].shape):
            raise CodebookMismatch(f"calibration samples must share one shape (the block's): "
                                   f"{tuple(items[0].shape)} and {tuple(t.shape)}")
    return items


def context_counts(samples: list[torch.Tensor], geometry: Geometry, sym: SymbolLayout) -> np.ndarray:
    """Symbol counts per context, (contexts, alphabet) int64, over every sample. Samples on a
    GPU are counted there (an engine learns its codebook from GPU blocks: copying them to the
    host and counting there cost it a few hundred milliseconds)."""
    counts = np.zeros(geometry.contexts * sym.alphabet, dtype=np.int64)
    ctx = None
    for t in samples:
        if t.is_cuda:
            counts += _device_counts(t, geometry, sym)
            continue
        bits = element_bits(t.detach().cpu().contiguous()).astype(np.int64)
        if ctx is None or ctx.size != bits.size:
            ctx = geometry.context_of(0, bits.size)
        counts += np.bincount(ctx * sym.alphabet + (bits >> sym.raw_bits), minlength=counts.size)
    return counts.reshape(geometry.contexts, sym.alphabet)


def _device_counts(t: torch.Tensor, geometry: Geometry, sym: SymbolLayout) -> np.ndarray:
    """``context_counts`` of one tensor, computed on its device."""
    layout = layout_for(t.dtype)
    bits = t.detach().contiguous().reshape(-1).view(layout.int_dtype).to(torch.int64) & ((1 << layout.total_bits) - 1)
    j = torch.arange(bits.numel(), dtype=torch.int64, device=t.device) % geometry.period
    ctx = (j // (geometry.tokens * geometry.inner)) * geometry.inner + j % geometry.inner
    index = ctx * sym.alphabet + (bits >> sym.raw_bits)
    return torch.bincount(index, minlength=geometry.contexts * sym.alphabet).cpu().numpy().astype(np.int64)


def _code_lengths(counts: np.ndarray) -> np.ndarray:
    """-log2 of each cluster's smoothed distribution, (clusters, symbols)."""
    p = counts + 1e-3 * (counts.sum(axis=1, keepdims=True) + 1) / counts.shape[1]
    return -np.log2(p / p.sum(axis=1, keepdims=True))


def cluster(counts: np.ndarray, tables: int) -> np.ndarray:
    """Table of each context: at most ``tables`` clusters that minimize the total code length.

    Initialization sorts contexts by their mean symbol (which orders them by magnitude, the
    main thing that differs between channels) and cuts that order into equal-mass groups;
    Lloyd rounds then move each context to the table that codes it in the fewest bits.
    """
    contexts = counts.shape[0]
    seen = counts.sum(axis=0) > 0
    x = counts[:, seen].astype(np.float64)
    mass = x.sum(axis=1)
    if tables <= 1 or contexts <= 1:
        return np.zeros(contexts, dtype=np.int64)
    symbols = np.arange(x.shape[1], dtype=np.float64)
    key = (x @ symbols) / np.maximum(mass, 1)
    order = np.lexsort((np.arange(contexts), key))
    cum = np.cumsum(mass[order])
    total = cum[-1] if cum.size and cum[-1] > 0 else 1.0
    assign = np.empty(contexts, dtype=np.int64)
    assign[order] = np.minimum((cum - mass[order] / 2) * tables // total, tables - 1).astype(np.int64)
    for _ in range(_LLOYD_ROUNDS):
        used = np.unique(assign)
        sums = _table_sums(assign, x, tables)[used]
        cost = x @ _code_lengths(sums).T  # (contexts, clusters)
        new = used[np.argmin(cost, axis=1)]
        if np.array_equal(new, assign):
            break
        assign = new
    return _renumber(assign)


def _table_sums(assign: np.ndarray, x: np.ndarray, tables: int) -> np.ndarray:
    """Rows of ``x`` summed by table (``assign``), as one product with the contexts' one-hot
    tables: ``np.add.at`` took seconds for the 65,536 contexts of a Llama-shaped block. Exact for
    counts below 2**53."""
    onehot = np.zeros((tables, assign.size))
    onehot[assign, np.arange(assign.size)] = 1.0
    return onehot @ x


def quantize(counts: np.ndarray, prob_bits: int, esc: int) -> np.ndarray:
    """Frequencies summing to ``2**prob_bits`` for one table: every seen symbol >= 1, the escape 1,
    the rest spread to minimize the code length of ``counts`` (greedy, ties to the smaller symbol)."""
    total = 1 << prob_bits
    freqs = np.zeros(counts.size, dtype=np.int64)
    freqs[esc] = 1
    seen = np.flatnonzero(counts > 0)
    seen = seen[seen != esc]
    if seen.size == 0:
        freqs[esc] = total
        return freqs.astype(np.int32)
    if seen.size + 1 > total:
        keep = seen[np.lexsort((seen, -counts[seen]))][: total - 1]
        seen = np.sort(keep)
    c = counts[seen].astype(np.float64)
    budget = total - 1
    f = np.maximum(1, np.floor(c * budget / c.sum())).astype(np.int64)
    # Move single slots one at a time to where they gain (or cost) the fewest bits.
    while f.sum() != budget:
        if f.sum() < budget:
            gain = c * np.log2((f + 1) / f)
            i = int(np.argmax(gain))
            f[i] += 1
        else:
            loss = np.where(f > 1, c * np.log2(f / np.maximum(f - 1, 1)), np.inf)
            i = int(np.argmin(loss))
            f[i] -= 1
    freqs[seen] = f
    return freqs.astype(np.int32)


def calibrate(samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
              tables: int = DEFAULT_TABLES, prob_bits: int = DEFAULT_PROB_BITS) -> EntropyCodebook:
    """A codebook fitted to ``samples``: tensors of one dtype and one shape, the shape of the
    period frames repeat with (one cache block, or one layer's ``[heads, tokens, head_dim]``;
    stack layers to give each layer contexts of its own). Calibrate K and V separately.

    Raises:
        CodebookMismatch: no samples, mixed dtypes or shapes, or bad parameters.
        UnsupportedTensor: a dtype the codec does not handle.
    """
    items = _samples_of(samples)
    return _fit(items, _geometry(tuple(items[0].shape), token_axis), tables, prob_bits)


def calibrate_blocks(blocks: torch.Tensor, *, token_axis: int | None = None, tables: int = DEFAULT_TABLES,
                     prob_bits: int = DEFAULT_PROB_BITS) -> EntropyCodebook:
    """A codebook for frames of whole cache blocks, fitted to ``blocks`` (``[n, *block]``):
    the period is one block and ``token_axis`` is an axis of the block, so the blocks' index
    is not a context (as it would be for ``calibrate(blocks)``, whose period is the stack).

    Raises:
        CodebookMismatch, UnsupportedTensor: as ``calibrate``.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dim() < 2 or not blocks.shape[0]:
        raise CodebookMismatch("calibrate_blocks needs a [blocks, *block] tensor of at least one block")
    layout_for(blocks.dtype)
    return _fit([blocks], _geometry(tuple(blocks.shape[1:]), token_axis), tables, prob_bits)


def _geometry(shape: tuple[int, ...], token_axis: int | None) -> Geometry:
    try:
        geometry = Geometry.of(shape, token_axis)
    except ValueError as exc:
        raise CodebookMismatch(str(exc)) from exc
    if geometry.contexts > MAX_CONTEXTS:
        raise CodebookMismatch(f"{geometry.contexts} contexts (positions off the token axis); at most "
                               f"{MAX_CONTEXTS}: calibrate on a smaller block or name the token axis")
    return geometry


def _fit(items: list[torch.Tensor], geometry: Geometry, tables: int, prob_bits: int) -> EntropyCodebook:
    """The codebook of ``items`` (each a whole number of periods) in ``geometry``."""
    layout = layout_for(items[0].dtype)
    sym = for_name(layout.name)
    if not 1 <= tables <= MAX_TABLES:
        raise CodebookMismatch(f"tables must be in 1..{MAX_TABLES}")
    counts = context_counts(items, geometry, sym)
    assign, freqs, cost = _refine(counts, cluster(counts, tables), prob_bits, sym)
    total = int(counts.sum())
    bits = float(cost / total) if total else 0.0
    return EntropyCodebook(layout.name, prob_bits, geometry, freqs, assign.astype(np.uint8), total, round(bits, 4))


def _renumber(assign: np.ndarray) -> np.ndarray:
    """Tables numbered in order of first use, so equal inputs give equal maps."""
    _, first = np.unique(assign, return_index=True)
    rank = np.empty(assign.max() + 1, dtype=np.int64)
    rank[assign[np.sort(first)]] = np.arange(first.size)
    return rank[assign]


def _refine(counts: np.ndarray, assign: np.ndarray, prob_bits: int, sym: SymbolLayout
            ) -> tuple[np.ndarray, np.ndarray, float]:
    """(map, frequencies, coded bits) after moving each context to the table whose Huffman
    codes (what frames are written with, escapes included) code it in the fewest bits, a few
    rounds. The cross-entropy clustering ignores that code lengths are whole bits."""
    from .huffman import code_lengths

    best = None
    weights = counts.astype(np.float64)
    for _ in range(_REFINE_ROUNDS + 1):
        assign = _renumber(assign)
        sums = np.rint(_table_sums(assign, weights, int(assign.max()) + 1)).astype(np.int64)
        freqs = np.stack([quantize(row, prob_bits, sym.esc) for row in sums])
        lengths = np.stack([code_lengths(row) for row in freqs]).astype(np.float64)
        per = np.where(lengths > 0, lengths, lengths[:, sym.esc:sym.esc + 1] + sym.sym_bits)
        cost = weights @ per.T  # (contexts, tables)
        total = float(cost[np.arange(assign.size), assign].sum())
        if best is not None and total >= best[2]:
            break
        best = (assign, freqs, total)
        new = np.argmin(cost, axis=1)
        if np.array_equal(new, assign):
            break
        assign = new
    return best
