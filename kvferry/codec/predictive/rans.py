"""Interleaved 64-bit rANS over per-element cumulative counts (the CPU reference coder).

Probabilities are 32-bit (``model.PROB_BITS``), states live in ``[2**32, 2**64)`` and words are
32 bits, so one symbol emits or reads at most one word. Element ``i`` belongs to lane
``i % lanes`` and is its ``i // lanes``-th symbol; the encoder runs the steps backwards and the
word stream is laid out in decoding order (step by step, lanes ascending within a step). Every
lane starts from (and the decoder must end on) the state ``2**32``: a free integrity check.

Vectorised across lanes with numpy: encoding costs a few array operations per step; decoding
searches each step's symbols by a B-ary search over the ordinals (``model.Elements.cdf_at`` at
B - 1 points per lane and round, B chosen so a round evaluates ~2048 points: few lanes take few
wide rounds instead of 16 narrow ones, since numpy's per-call cost dominates small arrays).
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptFrame
from .model import Elements

STATE_LOW = np.uint64(1 << 32)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def encode(starts: np.ndarray, freqs: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(final states ``(lanes,)`` uint64, words uint32) of the symbols ``[start, start + freq)``."""
    n = starts.size
    x = np.full(lanes, STATE_LOW, dtype=np.uint64)
    chunks: list[np.ndarray] = []
    steps = -(-n // lanes)
    for t in range(steps - 1, -1, -1):
        a = t * lanes
        b = min(a + lanes, n)
        xs = x[:b - a]
        f = freqs[a:b]
        emit = (xs >> _SHIFT) >= f
        if emit.any():
            chunks.append((xs[emit] & _MASK32).astype(np.uint32))
            xs[emit] >>= _SHIFT
        xs[:] = ((xs // f) << _SHIFT) + xs % f + starts[a:b]
    words = np.concatenate(chunks[::-1]) if chunks else np.zeros(0, dtype=np.uint32)
    return x, words


def decode(states: np.ndarray, words: np.ndarray, elements: Elements, n: int) -> np.ndarray:
    """Ordinals of the ``n`` elements from the final ``states`` and ``words``.

    Raises:
        CorruptFrame: the words run out or are left over, or a lane does not end on ``2**32``.
    """
    lanes = states.size
    if (states < STATE_LOW).any():
        raise CorruptFrame("a coder state is below 2**32")
    x = states.astype(np.uint64).copy()
    words = words.astype(np.uint64)
    out = np.empty(n, dtype=np.int64)
    size = elements.alpha.size
    pos = 0
    for a in range(0, n, lanes):
        b = min(a + lanes, n)
        k = b - a
        xs = x[:k]
        y = xs & _MASK32
        lo, c_lo, c_hi = _search(elements, np.arange(a, b), y, size)
        out[a:b] = lo
        xs[:] = (c_hi - c_lo) * (xs >> _SHIFT) + y - c_lo
        need = xs < STATE_LOW
        m = int(need.sum())
        if m:
            if pos + m > words.size:
                raise CorruptFrame("the word stream ends early")
            xs[need] = (xs[need] << _SHIFT) | words[pos:pos + m]
            pos += m
    if pos != words.size:
        raise CorruptFrame(f"{words.size - pos} words left over")
    if (x != STATE_LOW).any():
        raise CorruptFrame("a coder lane did not end on its initial state")
    return out


def _search(elements: Elements, idx: np.ndarray, y: np.ndarray, size: int) -> tuple[np.ndarray, ...]:
    """(o, C(o), C(o + 1)) per lane with ``C(o) <= y < C(o + 1)`` (C(0) = 0, C(size) = 2**32)."""
    k = idx.size
    branch = 2
    while branch < 256 and k * (2 * branch - 1) <= 2048:
        branch *= 2
    lo = np.zeros(k, dtype=np.int64)
    hi = np.full(k, size, dtype=np.int64)
    c_lo = np.zeros(k, dtype=np.uint64)
    c_hi = np.full(k, 1 << 32, dtype=np.uint64)
    steps = np.arange(1, branch, dtype=np.int64)
    rows = np.arange(k)
    lanes = elements.at(np.repeat(idx, branch - 1))  # gathered once per step, not per round
    while (hi - lo > 1).any():
        points = lo[:, None] + ((hi - lo)[:, None] * steps) // branch  # (k, branch - 1), ascending
        c = lanes.cdf_at(points.reshape(-1)).reshape(k, branch - 1)
        below = (c <= y[:, None]).sum(axis=1)  # points with C <= y form a prefix (C is monotone)
        has_lo, has_hi = below > 0, below < branch - 1
        j_lo, j_hi = np.maximum(below - 1, 0), np.minimum(below, branch - 2)
        lo = np.where(has_lo, points[rows, j_lo], lo)
        c_lo = np.where(has_lo, c[rows, j_lo], c_lo)
        hi = np.where(has_hi, points[rows, j_hi], hi)
        c_hi = np.where(has_hi, c[rows, j_hi], c_hi)
    return lo, c_lo, c_hi
