"""How each dtype splits into a coded symbol and raw bits, and the context of every element.

BF16 and FP16: the symbol is sign+exponent (the top 9 / 6 bits) and the mantissa (7 / 10 bits)
stays raw, since it is close to incompressible. FP8: the whole byte is the symbol. Symbol
``2**sym_bits`` of every table is the escape (ESC): it is followed by the symbol's raw bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..dtypes import FloatLayout, layout_by_name, layout_for
from ..errors import InvalidArgument


@dataclass(frozen=True)
class SymbolLayout:
    """``sym_bits`` coded bits on top of ``raw_bits`` raw bits (sym_bits + raw_bits = total)."""

    layout: FloatLayout
    sym_bits: int
    raw_bits: int

    @property
    def esc(self) -> int:
        """The escape symbol (one past the largest element symbol)."""
        return 1 << self.sym_bits

    @property
    def alphabet(self) -> int:
        """Symbols of a table, ESC included."""
        return (1 << self.sym_bits) + 1


def symbol_layout(layout: FloatLayout) -> SymbolLayout:
    """The split of ``layout``: sign+exponent coded for 16-bit floats, the whole byte for FP8."""
    if layout.total_bits == 8:
        return SymbolLayout(layout, 8, 0)
    sym = 1 + layout.exp_bits
    return SymbolLayout(layout, sym, layout.total_bits - sym)


def for_dtype(dtype: torch.dtype) -> SymbolLayout:
    return symbol_layout(layout_for(dtype))


def for_name(name: str) -> SymbolLayout:
    return symbol_layout(layout_by_name(name))


def element_bits(x: torch.Tensor) -> np.ndarray:
    """Flat element bits of a CPU tensor as numpy (uint16 or uint8), no copy when contiguous."""
    layout = layout_for(x.dtype)
    flat = x.detach().reshape(-1)
    if layout.total_bits == 16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.view(torch.uint8).numpy()


MIN_PERIOD = 128  # elements: four steps of 32 lanes


@dataclass(frozen=True)
class Geometry:
    """Where an element sits within its period ``outer x tokens x inner`` (the shape of one block
    with every axis before the token axis folded into ``outer`` and every one after into
    ``inner``). Elements that differ only in the token coordinate share a context, so there are
    ``outer * inner`` contexts; element i of a tensor is at position ``i mod period``."""

    outer: int
    tokens: int
    inner: int

    @property
    def period(self) -> int:
        return self.outer * self.tokens * self.inner

    @property
    def contexts(self) -> int:
        return self.outer * self.inner

    @classmethod
    def of(cls, shape: tuple[int, ...], token_axis: int | None) -> Geometry:
        """Geometry of a block of ``shape`` whose tokens run along ``token_axis``. Without a
        token axis every axis but the last is taken for tokens: contexts are channels, and the
        period is as few rows as reach ``MIN_PERIOD`` elements (the same contexts, and the small
        per-position tables the GPU coders' fast path needs, where the whole block would make
        them as large as it)."""
        shape = tuple(max(int(d), 1) for d in shape) or (1,)
        if token_axis is None:
            return cls(1, -(-MIN_PERIOD // shape[-1]), shape[-1])
        axis = token_axis + len(shape) if token_axis < 0 else token_axis
        if not 0 <= axis < len(shape):
            raise InvalidArgument(f"token_axis {token_axis} is not an axis of shape {shape}")
        return cls(int(np.prod(shape[:axis], dtype=np.int64)), shape[axis],
                   int(np.prod(shape[axis + 1:], dtype=np.int64)))

    def for_elements(self, n: int) -> Geometry:
        """The geometry that gives elements ``0 .. n-1`` the contexts this one gives them, its
        contexts a prefix of these, its period under ``2 n`` (this geometry where the period is
        at most ``n``). A frame may name a period far longer than its elements (a codebook
        learned on more blocks than a frame holds): a decoder's tables cover what they reach."""
        n = max(int(n), 1)
        outer = min(self.outer, -(-n // (self.tokens * self.inner)))
        tokens = self.tokens if outer > 1 else min(self.tokens, -(-n // self.inner))
        return Geometry(outer, tokens, min(self.inner, n))

    def context_of(self, start: int, n: int) -> np.ndarray:
        """Context (int64) of elements ``start .. start+n-1`` of a flat tensor."""
        j = (np.arange(n, dtype=np.int64) + start) % self.period
        return (j // (self.tokens * self.inner)) * self.inner + j % self.inner
