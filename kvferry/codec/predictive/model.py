"""The probability model that defines a predictive frame's bytes, in integers.

Each element is one symbol of its dtype (all ``2**bits`` bit patterns, NaNs included), ordered
by value (``ordinal``): negative patterns reversed below the positive ones, so -NaN < -Inf < ... <
-0 < +0 < ... < +Inf < +NaN. A symbol's bin runs from the midpoint with its lower neighbour to the
midpoint with its upper one (the extreme finite values take the tails; Inf and NaN get empty bins).

The coded distribution is the paper's mixture, bin-integrated::

    q(o) = 0.95 N(mu, s^2)[bin o] + 0.03 N(mu, (3s)^2)[bin o] + 0.02 marginal(o)

turned into a cumulative count out of ``2**32`` that every machine computes identically:
the normal CDF is read from a frozen integer table (``_phi.py``) with integer interpolation,
the only float operations are IEEE-exact ``(edge - mu) / s`` and ``/ 3``, and every symbol gets
one count on top of its share, so NaN, Inf and values far from the prediction stay codable::

    C(o) = ((w1 Phi(z) + w3 Phi(z / 3) + wm M(o)) >> 18) * (2**(32 - bits) - 1) >> (32 - bits) + o

with ``w1 + w3 + wm = 2**20``, ``Phi`` and ``M`` (the marginal's cumulative share) out of ``2**30``;
``C(0) = 0`` and ``C(2**bits) = 2**32`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..dtypes import FloatLayout, layout_by_name
from ._phi import PHI, PHI_SCALE_BITS, PHI_STEPS_PER_UNIT, PHI_Z_MAX

PROB_BITS = 32
MIX = (0.95, 0.03, 0.02)
MIX_BITS = 20
# 0.95, 0.03, 0.02 out of 2**20 (996147.2, 31457.28, 20971.52), rounded to sum 2**20 exactly
MIX_WEIGHTS = (996147, 31457, 20972)
assert sum(MIX_WEIGHTS) == 1 << MIX_BITS
MARGINAL_BITS = PHI_SCALE_BITS  # the marginal's cumulative share, out of 2**30
_FRAC_BITS = 12
_PHI_LAST = PHI.size - 1


@dataclass(frozen=True, eq=False)
class Alphabet:
    """A dtype's symbols in value order: ``ordinal[bits]``, ``bits_of[ordinal]``, bin ``edges``."""

    layout: FloatLayout
    bits: int
    ordinal: np.ndarray  # (size,) int64, symbol bits -> ordinal
    bits_of: np.ndarray  # (size,) int64, ordinal -> symbol bits
    edges: np.ndarray  # (size + 1,) float64, bin of ordinal o is [edges[o], edges[o + 1])

    @property
    def size(self) -> int:
        return 1 << self.bits


@lru_cache(maxsize=None)
def alphabet(dtype_name: str) -> Alphabet:
    """The alphabet of a float dtype (``"bfloat16"``, ``"float8_e4m3fn"``, ...)."""
    layout = layout_by_name(dtype_name)
    bits = layout.total_bits
    size, sign = 1 << bits, 1 << (bits - 1)
    sym = np.arange(size, dtype=np.int64)
    ordinal = np.where(sym & sign, (size - 1) - sym, sym + sign)
    bits_of = np.empty(size, dtype=np.int64)
    bits_of[ordinal] = sym
    int_dtype = np.int16 if bits == 16 else np.uint8
    values = torch.from_numpy(bits_of.astype(np.uint16 if bits == 16 else np.uint8).view(int_dtype))
    values = values.view(layout.dtype).to(torch.float64).numpy()
    finite = np.flatnonzero(np.isfinite(values))
    first, last = int(finite[0]), int(finite[-1])
    edges = np.empty(size + 1, dtype=np.float64)
    edges[:first + 1] = -np.inf
    edges[last + 1:] = np.inf
    edges[first + 1:last + 1] = (values[first:last] + values[first + 1:last + 1]) / 2
    for array in (ordinal, bits_of, edges):
        array.setflags(write=False)
    return Alphabet(layout, bits, ordinal, bits_of, edges)


def marginal_cdf(counts: np.ndarray, alpha: Alphabet) -> np.ndarray:
    """Cumulative share ``M(o)`` (out of ``2**30``, ``len = size + 1``) of the smoothed marginal
    ``(count + 1) / (total + size)``; ``counts`` are indexed by symbol bits."""
    smoothed = counts.astype(np.int64)[alpha.bits_of] + 1
    cum = np.zeros(alpha.size + 1, dtype=np.int64)
    np.cumsum(smoothed, out=cum[1:])
    total = int(cum[-1])
    assert total < 1 << 33  # cum << 30 fits int64; the codebook keeps totals below 2**32
    return (cum << MARGINAL_BITS) // total


def phi(z: np.ndarray) -> np.ndarray:
    """``Phi(z)`` out of ``2**30`` (int64) from the frozen table, interpolated in integers."""
    u = (np.clip(z, -PHI_Z_MAX, PHI_Z_MAX) + PHI_Z_MAX) * float(PHI_STEPS_PER_UNIT << _FRAC_BITS)
    ui = u.astype(np.int64)
    i = ui >> _FRAC_BITS
    frac = ui & ((1 << _FRAC_BITS) - 1)
    lo = PHI[i]
    hi = PHI[np.minimum(i + 1, _PHI_LAST)]
    return lo + (((hi - lo) * frac) >> _FRAC_BITS)


def cdf(o: np.ndarray, mu: np.ndarray, sigma: np.ndarray, marg: np.ndarray, alpha: Alphabet) -> np.ndarray:
    """``C(o)`` (uint64, out of ``2**32``) at ordinals ``o`` (0..size) of elements with prediction
    ``mu``, scale ``sigma`` (float64, finite, > 0) and marginal share ``marg = M(o)`` (int64)."""
    z = (alpha.edges[o] - mu) / sigma
    p = phi(np.concatenate([z, z / 3.0]))  # one table pass for both Gaussians
    w1, w3, wm = MIX_WEIGHTS
    mix = w1 * p[:z.size] + w3 * p[z.size:] + wm * marg
    shift = PROB_BITS - alpha.bits
    g = ((mix >> (MIX_BITS + MARGINAL_BITS - PROB_BITS)).astype(np.uint64) * np.uint64((1 << shift) - 1)) \
        >> np.uint64(shift)
    return g + o.astype(np.uint64)


class Elements:
    """The per-element model inputs of one tensor: prediction, scale, marginal table row."""

    def __init__(self, mu: np.ndarray, sigma: np.ndarray, kv: np.ndarray, marginals: np.ndarray,
                 alpha: Alphabet) -> None:
        # A reference holding NaN/Inf predicts nothing useful; 0 keeps the arithmetic finite
        # (and identical on both sides, which is all losslessness needs).
        self.mu = np.where(np.isfinite(mu), mu, 0.0).astype(np.float64)
        self.sigma = sigma.astype(np.float64)
        self.kv = kv.astype(np.int64)
        self.flat_marg = marginals.reshape(-1)  # (2 * (size + 1),)
        self.alpha = alpha
        self.row = self.kv * (alpha.size + 1)

    def cdf_at(self, o: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """``C(o)`` for element ``idx[j]`` at ordinal ``o[j]`` (all elements when ``idx`` is None)."""
        if idx is None:
            return cdf(o, self.mu, self.sigma, self.flat_marg[self.row + o], self.alpha)
        return self.at(idx).cdf_at(o)

    def at(self, idx: np.ndarray) -> Elements:
        """The elements ``idx`` (repeats allowed) as an ``Elements`` of their own."""
        sub = object.__new__(Elements)
        sub.mu, sub.sigma, sub.kv, sub.row = self.mu[idx], self.sigma[idx], self.kv[idx], self.row[idx]
        sub.flat_marg, sub.alpha = self.flat_marg, self.alpha
        return sub
