"""Low-rank codebooks: per (layer, K/V, head) an orthonormal rotation, a mean and a rank.

Calibration (ZACK's projection, section 3.1 of the paper): the sample vectors of one head (one
layer, K or V) are the rows of a matrix A; the eigenvectors of the scatter matrix (A - mean)^T
(A - mean), computed in float64, are the right singular vectors of A - mean, sorted by falling
eigenvalue. They form the columns of R; a vector is coded as its first r coordinates in that
basis. Which r: the smallest keeping ``energy`` of the head's energy, or the ``rank_budget``
ranks (summed over all heads) that keep the most energy in all.

Energy, here: the sum of squared deviations from the head's mean (its variance times the number
of vectors), or the plain sum of squares when ``center=False``. The energy a rank-r code drops
is exactly the squared reconstruction error it causes on the calibration vectors.

Everything is deterministic: eigenvalue ties keep index order, and each column's sign is fixed
(its entry of largest magnitude, the first such, is positive).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CodebookMismatch

FORMAT_NAME = "kvferry-lowrank-codebook"
CODEBOOK_VERSION = 1
GROUP_AXES = ("layer", "kv", "head")
QUANTIZERS = (None, "k8v4")
MIN_CHANNELS, MAX_CHANNELS = 4, 1024
MAX_GROUPS = 1 << 16


@dataclass(frozen=True, eq=False)
class LowRankCodebook:
    """Rotations ``(groups, d, d)`` float32 (column k: the k-th direction), means ``(groups, d)``
    float32 and ranks ``(groups,)``; group ``g = (layer * kv + k_or_v) * heads + head``.

    ``dims`` = (layers, kv, heads, d); a codebook calibrated without axis names is one group
    (1, 1, 1, d) that codes every vector along the last axis alike.
    """

    dims: tuple[int, int, int, int]
    rotations: np.ndarray
    means: np.ndarray
    ranks: np.ndarray
    center: bool = True
    quantize: str | None = None
    selection: dict = field(default_factory=dict)  # {"energy": e} or {"rank_budget": n}
    axes: tuple[str, ...] | None = None  # the calibration samples' axis names (None: pooled)
    captured: tuple[float, ...] = ()  # fraction of each group's energy its rank keeps
    samples: int = 0  # vectors per group
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        problem = _check(self)
        if problem:
            raise CodebookMismatch(f"lowrank codebook: {problem}")

    @property
    def groups(self) -> int:
        return int(self.ranks.size)

    @property
    def channels(self) -> int:
        return self.dims[3]

    @property
    def pooled(self) -> bool:
        """Calibrated without axis names: one group, any tensor's last axis is the channel."""
        return self.axes is None

    def bits(self) -> np.ndarray:
        """Code bits per coefficient of each group under ``quantize`` (8 for K, 4 for V; 16 = bf16)."""
        if self.quantize is None:
            return np.full(self.groups, 16, dtype=np.int32)
        kv = (np.arange(self.groups) // self.dims[2]) % self.dims[1]
        return np.where(kv == 1, 4, 8).astype(np.int32)

    def summary(self) -> str:
        """One line for people: groups, mean rank, the selection rule, the quantizer."""
        rule = ", ".join(f"{k} {v}" for k, v in self.selection.items())
        return (f"{self.groups} heads x {self.channels} channels, mean rank {float(self.ranks.mean()):.1f} "
                f"({rule}), coefficients {self.quantize or 'bf16'}")

    def to_json(self) -> str:
        if "json" not in self._cache:
            self._cache["json"] = json.dumps({
                "format": FORMAT_NAME, "version": CODEBOOK_VERSION,
                "dims": {"layers": self.dims[0], "kv": self.dims[1], "heads": self.dims[2],
                         "channels": self.dims[3]},
                "axes": list(self.axes) if self.axes is not None else None,
                "center": self.center, "quantize": self.quantize, "selection": self.selection,
                "ranks": [int(r) for r in self.ranks],
                "rotations": _b64(self.rotations), "means": _b64(self.means),
                "captured": list(self.captured), "samples": self.samples,
            }, sort_keys=True)
        return self._cache["json"]

    def digest(self) -> bytes:
        """blake2b-8 of ``to_json()``: what frames carry to name the codebook they need."""
        if "digest" not in self._cache:
            self._cache["digest"] = hashlib.blake2b(self.to_json().encode(), digest_size=8).digest()
        return self._cache["digest"]

    def layer(self, index: int) -> LowRankCodebook:
        """The one-layer codebook of layer ``index`` (for regions that hold one layer's KV)."""
        layers, kv, heads, d = self.dims
        if not 0 <= index < layers:
            raise CodebookMismatch(f"layer {index} of a {layers}-layer codebook")
        sl = slice(index * kv * heads, (index + 1) * kv * heads)
        axes = tuple(a for a in self.axes if a != "layer") if self.axes is not None else None
        return LowRankCodebook((1, kv, heads, d), self.rotations[sl].copy(), self.means[sl].copy(),
                               self.ranks[sl].copy(), self.center, self.quantize, dict(self.selection), axes,
                               self.captured[sl], self.samples)

    @classmethod
    def from_json(cls, text: str | bytes) -> LowRankCodebook:
        """Parse ``to_json`` output.

        Raises:
            CodebookMismatch: not a lowrank codebook of this version, or invalid contents.
        """
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
                raise CodebookMismatch(f"not a {FORMAT_NAME} document")
            if doc.get("version") != CODEBOOK_VERSION:
                raise CodebookMismatch(f"lowrank codebook version {doc.get('version')!r}, "
                                       f"this build reads {CODEBOOK_VERSION}")
            dd = doc["dims"]
            dims = (int(dd["layers"]), int(dd["kv"]), int(dd["heads"]), int(dd["channels"]))
            g, d = dims[0] * dims[1] * dims[2], dims[3]
            if not (0 < g <= MAX_GROUPS and MIN_CHANNELS <= d <= MAX_CHANNELS):
                raise CodebookMismatch(f"bad dims {dims}")
            rotations = _unb64(doc["rotations"], g * d * d).reshape(g, d, d)
            means = _unb64(doc["means"], g * d).reshape(g, d)
            axes = doc["axes"]
            sel = doc["selection"]
            if not isinstance(sel, dict):
                raise CodebookMismatch("selection must be an object")
            return cls(dims, rotations, means, np.asarray([int(r) for r in doc["ranks"]], dtype=np.int64),
                       bool(doc["center"]), doc["quantize"], sel,
                       tuple(str(a) for a in axes) if axes is not None else None,
                       tuple(float(c) for c in doc["captured"]), int(doc["samples"]))
        except CodebookMismatch:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CodebookMismatch(f"malformed lowrank codebook JSON: {exc}") from exc


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _unb64(text: str, count: int) -> np.ndarray:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 4 * count:
        raise CodebookMismatch(f"{len(raw)} bytes where {count} float32 values belong")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def _check(book: LowRankCodebook) -> str | None:
    dims = book.dims
    if len(dims) != 4 or min(dims) < 1:
        return f"bad dims {dims}"
    g, d = dims[0] * dims[1] * dims[2], dims[3]
    if not MIN_CHANNELS <= d <= MAX_CHANNELS or g > MAX_GROUPS:
        return f"head dim {d} outside {MIN_CHANNELS}..{MAX_CHANNELS} or {g} groups"
    if dims[1] not in (1, 2):
        return f"kv dim {dims[1]} (1 or 2)"
    if book.rotations.shape != (g, d, d) or book.rotations.dtype != np.float32:
        return f"rotations must be float32 {(g, d, d)}"
    if book.means.shape != (g, d) or book.means.dtype != np.float32:
        return f"means must be float32 {(g, d)}"
    if not (np.isfinite(book.rotations).all() and np.isfinite(book.means).all()):
        return "rotations and means must be finite"
    if not book.center and book.means.any():
        return "an uncentered codebook has zero means"
    if book.ranks.shape != (g,) or (book.ranks < 0).any() or (book.ranks > d).any():
        return f"ranks must be {g} integers in 0..{d}"
    if book.quantize not in QUANTIZERS:
        return f"unknown quantizer {book.quantize!r} (known: k8v4)"
    if book.axes is not None and (len(set(book.axes)) != len(book.axes) or "channel" not in book.axes):
        return f"bad axes {book.axes}"
    if book.axes is None and g != 1:
        return "a codebook without axes has one group"
    if len(book.captured) not in (0, g):
        return "captured needs one entry per group"
    return None


def _samples_of(samples: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    items = [samples] if isinstance(samples, torch.Tensor) else list(samples)
    if not items:
        raise CodebookMismatch("calibration needs at least one tensor")
    for t in items:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise CodebookMismatch("calibration samples are floating-point tensors")
        if tuple(t.shape) != tuple(items[0].shape):
            raise CodebookMismatch(f"calibration samples must share one shape: "
                                   f"{tuple(items[0].shape)} and {tuple(t.shape)}")
    return items


def group_vectors(items: list[torch.Tensor], axes: Sequence[str] | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """Sample vectors per group, float64 ``(groups, vectors, d)``, and the dims (layers, kv, heads, d)."""
    shape = tuple(items[0].shape)
    if axes is None:
        if not shape:
            raise CodebookMismatch("calibration samples need a channel axis")
        d = shape[-1]
        flat = np.concatenate([t.detach().cpu().float().reshape(-1, d).double().numpy() for t in items])
        return flat[None], (1, 1, 1, d)
    axes = tuple(axes)
    if len(axes) != len(shape) or len(set(axes)) != len(axes):
        raise CodebookMismatch(f"axes {list(axes)} do not name the {len(shape)} dimensions of {shape}")
    if "channel" not in axes:
        raise CodebookMismatch(f"axes {list(axes)} name no channel axis")
    if "kv" in axes and shape[axes.index("kv")] not in (1, 2):
        raise CodebookMismatch(f"the kv axis has {shape[axes.index('kv')]} entries (K, V)")
    group_pos = [axes.index(a) for a in GROUP_AXES if a in axes]
    rest = [i for i, a in enumerate(axes) if a not in GROUP_AXES and a != "channel"]
    perm = group_pos + rest + [axes.index("channel")]
    sizes = [shape[axes.index(a)] if a in axes else 1 for a in GROUP_AXES]
    d = shape[axes.index("channel")]
    g = sizes[0] * sizes[1] * sizes[2]
    parts = [t.detach().cpu().float().permute(perm).reshape(g, -1, d).double().numpy() for t in items]
    return np.concatenate(parts, axis=1), (*sizes, d)


def _directions(a: np.ndarray, center: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Means, eigenvalues (falling) and eigenvectors (columns, signs fixed) of each group of
    ``a`` ``(groups, vectors, d)`` float64."""
    mean = a.mean(axis=1) if center else np.zeros((a.shape[0], a.shape[2]))
    dev = a - mean[:, None, :]
    scatter = np.matmul(dev.transpose(0, 2, 1), dev)
    values, vectors = np.linalg.eigh(scatter)  # ascending
    order = np.argsort(-values, axis=1, kind="stable")
    values = np.maximum(np.take_along_axis(values, order, axis=1), 0.0)
    vectors = np.take_along_axis(vectors, order[:, None, :], axis=2)
    lead = np.argmax(np.abs(vectors), axis=1)  # (groups, d): row of each column's largest entry
    picked = np.take_along_axis(vectors, lead[:, None, :], axis=1)[:, 0, :]
    return mean, values, vectors * np.where(picked < 0, -1.0, 1.0)[:, None, :]


def _ranks_by_energy(values: np.ndarray, energy: float) -> np.ndarray:
    d = values.shape[1]
    if energy >= 1.0:
        return np.full(values.shape[0], d, dtype=np.int64)
    total = values.sum(axis=1, keepdims=True)
    kept = np.cumsum(values, axis=1)
    enough = kept >= energy * total
    return np.where(total[:, 0] > 0, np.argmax(enough, axis=1) + 1, 0).astype(np.int64)


def _ranks_by_budget(values: np.ndarray, budget: int) -> np.ndarray:
    # Eigenvalues fall within a group, so taking the budget's largest overall takes each group's
    # leading ones: the choice that keeps the most energy in all. Ties: lower group, lower index.
    g, d = values.shape
    flat = values.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))[:budget]
    return np.bincount(order // d, minlength=g).astype(np.int64)


def calibrate(samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
              axes: Sequence[str] | None = None, energy: float = 0.99, rank_budget: int | None = None,
              quantize: str | None = None, center: bool = True) -> LowRankCodebook:
    """A codebook fitted to ``samples``: tensors of one shape whose dimensions ``axes`` names
    (``layer``, ``kv``, ``head``, ``channel``; any other name, e.g. ``token``, just indexes
    vectors). Without ``axes`` every vector along the last axis is pooled into one group
    (``token_axis`` is then irrelevant: all non-channel axes index vectors).

    Raises:
        CodebookMismatch: no samples, mixed shapes, bad axes, or bad parameters.
    """
    del token_axis  # vectors run along the channel axis; every other axis indexes them
    items = _samples_of(samples)
    if quantize not in QUANTIZERS:
        raise CodebookMismatch(f"unknown quantizer {quantize!r} (known: k8v4)")
    if rank_budget is None and not 0.0 < energy <= 1.0:
        raise CodebookMismatch(f"energy {energy} outside (0, 1]")
    vectors, dims = group_vectors(items, axes)
    g, n, d = vectors.shape
    if not MIN_CHANNELS <= d <= MAX_CHANNELS:
        raise CodebookMismatch(f"head dim {d} outside {MIN_CHANNELS}..{MAX_CHANNELS}")
    if rank_budget is not None and not 0 <= rank_budget <= g * d:
        raise CodebookMismatch(f"rank budget {rank_budget} outside 0..{g * d} ({g} heads of {d})")
    means, values, rotations = _directions(vectors, center)
    if rank_budget is not None:
        ranks, selection = _ranks_by_budget(values, rank_budget), {"rank_budget": int(rank_budget)}
    else:
        ranks, selection = _ranks_by_energy(values, energy), {"energy": float(energy)}
    total = values.sum(axis=1)
    kept = np.array([values[i, :ranks[i]].sum() for i in range(g)])
    captured = tuple(round(float(k / t), 6) if t > 0 else 1.0 for k, t in zip(kept, total))
    return LowRankCodebook(dims, rotations.astype(np.float32), means.astype(np.float32), ranks, center, quantize,
                           selection, tuple(axes) if axes is not None else None, captured, int(n))
