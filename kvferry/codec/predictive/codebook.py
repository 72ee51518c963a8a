"""The predictive codebook: the sigma table and the marginal, fitted once on calibration text.

``sigma[layer, kv, head, channel]`` is the root-mean-square residual ``target - predictor`` over
every other axis (tokens, blocks, passages) of the calibration pairs: the optimal Gaussian scale.
``marginal[kv, symbol]`` counts the target's symbols (bit patterns) for K and V. Both sides of a
transfer hold the same codebook; frames name it by ``digest`` (64 bits of SHA-256 over the
canonical bytes) and a decoder refuses a frame made with another.

    book = calibrate_predictive(target_kv, predictor_kv, axes=("layer", "kv", "head", "token", "channel"))
    text = book.to_json()                          # versioned JSON
    book = PredictiveCodebook.from_json(text)      # CodebookMismatch if it is not one of ours
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dtypes import layout_by_name, layout_for
from ..errors import CodebookMismatch, UnsupportedTensor
from .model import Alphabet, alphabet, marginal_cdf

FORMAT_NAME = "kvferry-predictive-codebook"
CODEBOOK_VERSION = 1
TABLE_AXES = ("layer", "kv", "head", "channel")
# A residual that is exactly zero (predictor == target on a channel) would make sigma 0; the
# floor keeps z finite and still puts all of the Gaussian's mass on the predicted bin.
SIGMA_MIN = 2.0 ** -24
_REFERENCE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, eq=False)
class PredictiveCodebook:
    """Sigma table ``(layers, 2, heads, channels)`` float32 and marginal counts ``(2, 2**bits)``
    for a target of ``dtype`` predicted from a reference of ``reference_dtype``."""

    dtype: str
    reference_dtype: str
    sigma: np.ndarray
    marginal: np.ndarray
    samples: int = 0
    predictor: str = ""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            alpha = alphabet(self.dtype)
        except UnsupportedTensor as exc:
            raise CodebookMismatch(str(exc)) from exc
        if self.reference_dtype not in _REFERENCE_DTYPES:
            raise CodebookMismatch(f"reference dtype {self.reference_dtype!r} is not one of {_REFERENCE_DTYPES}")
        s = self.sigma
        if s.dtype != np.float32 or s.ndim != 4 or s.shape[1] != 2 or min(s.shape) < 1:
            raise CodebookMismatch(f"sigma table must be float32 (layers, 2, heads, channels), got {s.dtype}{s.shape}")
        if not (np.isfinite(s).all() and (s >= SIGMA_MIN).all()):
            raise CodebookMismatch(f"sigma table entries must be finite and >= {SIGMA_MIN}")
        m = self.marginal
        if m.shape != (2, alpha.size) or m.dtype != np.int64 or (m < 0).any() or int(m.sum(axis=1).max()) >= 1 << 32:
            raise CodebookMismatch(f"marginal must be int64 counts (2, {alpha.size}) below 2**32 per row")

    @property
    def alphabet(self) -> Alphabet:
        return alphabet(self.dtype)

    @property
    def layers(self) -> int:
        return self.sigma.shape[0]

    @property
    def heads(self) -> int:
        return self.sigma.shape[2]

    @property
    def channels(self) -> int:
        return self.sigma.shape[3]

    def canonical_bytes(self) -> bytes:
        """What ``digest`` covers: dtypes, table shape, sigma (f32 LE), marginal (i64 LE)."""
        head = f"{FORMAT_NAME}/{CODEBOOK_VERSION}/{self.dtype}/{self.reference_dtype}".encode()
        return (head + struct.pack("<4Q", *self.sigma.shape) + self.sigma.astype("<f4").tobytes()
                + self.marginal.astype("<i8").tobytes())

    @property
    def digest(self) -> int:
        """64-bit name of this codebook (a frame's ``sigma digest``)."""
        if "digest" not in self._cache:
            self._cache["digest"] = int.from_bytes(hashlib.sha256(self.canonical_bytes()).digest()[:8], "little")
        return self._cache["digest"]

    def marginal_cdfs(self) -> np.ndarray:
        """``M`` of K and V, ``(2, 2**bits + 1)`` int64 out of ``2**30`` (model.marginal_cdf)."""
        if "marg" not in self._cache:
            self._cache["marg"] = np.stack([marginal_cdf(row, self.alphabet) for row in self.marginal])
        return self._cache["marg"]

    def to_json(self) -> str:
        sparse = [[[int(s), int(row[s])] for s in np.flatnonzero(row)] for row in self.marginal]
        return json.dumps({
            "format": FORMAT_NAME, "version": CODEBOOK_VERSION, "dtype": self.dtype,
            "reference_dtype": self.reference_dtype, "axes": list(TABLE_AXES), "shape": list(self.sigma.shape),
            "sigma_f32le": base64.b64encode(self.sigma.astype("<f4").tobytes()).decode(),
            "marginal": {"K": sparse[0], "V": sparse[1]}, "samples": self.samples,
            "predictor": self.predictor, "digest": f"{self.digest:016x}",
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PredictiveCodebook:
        """Parse ``to_json``'s document.

        Raises:
            CodebookMismatch: not a predictive codebook of a version this build reads, malformed,
                or its digest does not match its contents.
        """
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT_NAME:
                raise CodebookMismatch(f"not a {FORMAT_NAME} document")
            if doc.get("version") != CODEBOOK_VERSION:
                raise CodebookMismatch(f"predictive codebook version {doc.get('version')} (this build reads "
                                       f"{CODEBOOK_VERSION})")
            if doc["axes"] != list(TABLE_AXES):
                raise CodebookMismatch(f"sigma axes {doc['axes']}, expected {list(TABLE_AXES)}")
            shape = tuple(int(d) for d in doc["shape"])
            sigma = np.frombuffer(base64.b64decode(doc["sigma_f32le"]), dtype="<f4").astype(np.float32)
            sigma = sigma.reshape(shape)
            size = 1 << layout_by_name(doc["dtype"]).total_bits
            marginal = np.zeros((2, size), dtype=np.int64)
            for row, key in enumerate(("K", "V")):
                for sym, count in doc["marginal"][key]:
                    marginal[row, int(sym)] = int(count)
            book = cls(doc["dtype"], doc["reference_dtype"], sigma, marginal, int(doc.get("samples", 0)),
                       str(doc.get("predictor", "")))
        except CodebookMismatch:
            raise
        except (ValueError, KeyError, TypeError, IndexError, UnsupportedTensor) as exc:
            raise CodebookMismatch(f"malformed predictive codebook: {exc}") from exc
        if f"{book.digest:016x}" != doc.get("digest"):
            raise CodebookMismatch("predictive codebook digest does not match its contents")
        return book


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise CodebookMismatch("calibration needs one or more tensors")
    return items


def table_view(t: torch.Tensor, axes: Sequence[str]) -> torch.Tensor:
    """``t`` (dims named by ``axes``) as ``(layer, kv, head, channel, rest)``; a missing layer axis
    is a layer of one. Raises ``CodebookMismatch`` if kv, head or channel is not named."""
    axes = tuple(axes)
    if len(axes) != t.dim() or len(set(axes)) != len(axes):
        raise CodebookMismatch(f"{len(axes)} distinct axis names needed for a {t.dim()}-d tensor, got {list(axes)}")
    missing = [a for a in TABLE_AXES[1:] if a not in axes]
    if missing:
        raise CodebookMismatch(f"predictive needs the {', '.join(missing)} axis named (axes: {list(axes)})")
    if "layer" not in axes:
        t, axes = t.unsqueeze(0), ("layer",) + axes
    if t.shape[axes.index("kv")] != 2:
        raise CodebookMismatch("the kv axis must have 2 entries (K, V)")
    order = [axes.index(a) for a in TABLE_AXES] + [i for i, a in enumerate(axes) if a not in TABLE_AXES]
    t = t.permute(order)
    return t.reshape(*t.shape[:4], -1)


def calibrate_predictive(target: torch.Tensor | Sequence[torch.Tensor],
                         predictor: torch.Tensor | Sequence[torch.Tensor], axes: Sequence[str], *,
                         predictor_name: str = "") -> PredictiveCodebook:
    """Fit the sigma table and marginal on calibration pairs.

    ``target[i]`` and ``predictor[i]`` are the target model's and the predictor's KV of the same
    prompt, same shape, dims named by ``axes`` (``kv``, ``head``, ``channel`` required; ``layer``
    optional; everything else, tokens included, is pooled). The target's dtype is what the codec
    will code (bf16, fp16, fp8); the predictor's is what reference regions must hold.

    Raises:
        CodebookMismatch: no or mismatched pairs, missing axes, mixed dtypes.
        UnsupportedTensor: a target dtype the codec does not handle.
    """
    targets, predictors = _as_list(target), _as_list(predictor)
    if len(targets) != len(predictors):
        raise CodebookMismatch(f"{len(targets)} target tensors, {len(predictors)} predictor tensors")
    dtype, ref_dtype = targets[0].dtype, predictors[0].dtype
    layout = layout_for(dtype)
    alpha = alphabet(layout.name)
    sq = count = None
    marginal = np.zeros((2, alpha.size), dtype=np.int64)
    for t, p in zip(targets, predictors):
        if t.shape != p.shape or t.dtype != dtype or p.dtype != ref_dtype:
            raise CodebookMismatch(f"calibration pair {t.dtype}{list(t.shape)} / {p.dtype}{list(p.shape)} does not "
                                   f"match the first {dtype} / {ref_dtype} pair")
        tv, pv = table_view(t.detach().cpu(), axes), table_view(p.detach().cpu(), axes)
        r = tv.to(torch.float64) - pv.to(torch.float64)
        ok = torch.isfinite(r)
        r = torch.where(ok, r, 0.0)
        s, c = (r * r).sum(dim=-1), ok.sum(dim=-1)
        if sq is None:
            sq, count = s, c
        elif s.shape != sq.shape:
            raise CodebookMismatch(f"calibration tensors disagree on (layer, kv, head, channel): "
                                   f"{tuple(s.shape)} vs {tuple(sq.shape)}")
        else:
            sq, count = sq + s, count + c
        bits = tv.contiguous().view(layout.int_dtype).numpy().astype(np.int64) & (alpha.size - 1)
        for kv in (0, 1):
            marginal[kv] += np.bincount(bits[:, kv].reshape(-1), minlength=alpha.size)
    sigma = torch.sqrt(sq / count.clamp_min(1)).clamp_min(SIGMA_MIN).numpy().astype(np.float32)
    sigma = np.maximum(sigma, np.float32(SIGMA_MIN))  # rounding to f32 must not undercut the floor
    while int(marginal.sum(axis=1).max()) >= 1 << 32:  # keep the marginal's integer model in range
        marginal = (marginal + 1) // 2
    return PredictiveCodebook(layout.name, _dtype_name(ref_dtype), sigma, marginal,
                              int(count.sum()), predictor_name)
