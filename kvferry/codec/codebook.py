"""Exponent codebooks: the top-2**code_bits exponents of calibration data, ordered by code."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .dtypes import FloatLayout, layout_by_name, layout_for
from .errors import CodebookMismatch
from .fields import exponent_histogram

_FORMAT = "kvferry-codebook"
_VERSION = 1


@dataclass(frozen=True)
class Codebook:
    """Exponent value for each code (code i decodes to ``exponents[i]``).

    ``coverage`` is the fraction of calibration elements whose exponent is in the book and
    ``samples`` how many elements were seen; both are informational.
    """

    dtype: str
    exponents: tuple[int, ...]
    coverage: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        layout = self.layout
        size, limit = layout.codebook_size, 1 << layout.exp_bits
        if len(self.exponents) != size or len(set(self.exponents)) != size:
            raise CodebookMismatch(f"{self.dtype} codebook needs {size} distinct exponents, got {self.exponents}")
        if not all(0 <= e < limit for e in self.exponents):
            raise CodebookMismatch(f"{self.dtype} exponents must be in 0..{limit - 1}, got {self.exponents}")

    @property
    def layout(self) -> FloatLayout:
        try:
            return layout_by_name(self.dtype)
        except Exception as exc:
            raise CodebookMismatch(str(exc)) from exc

    @classmethod
    def from_histogram(cls, dtype: str, histogram: torch.Tensor) -> Codebook:
        """Top exponents by count, ties broken by smaller exponent; unseen values fill the rest."""
        layout = layout_by_name(dtype)
        counts = histogram.to(torch.int64).cpu().tolist()
        order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        top = tuple(order[: layout.codebook_size])
        total = sum(counts)
        covered = sum(counts[e] for e in top)
        return cls(dtype, top, covered / total if total else 0.0, total)

    def to_json(self) -> str:
        return json.dumps({
            "format": _FORMAT, "version": _VERSION, "dtype": self.dtype,
            "exponents": list(self.exponents), "coverage": self.coverage, "samples": self.samples,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Codebook:
        """Parse ``to_json`` output.

        Raises:
            CodebookMismatch: not a kvferry codebook, unknown version or invalid contents.
        """
        try:
            doc = json.loads(text)
            if doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
                raise CodebookMismatch(f"not a {_FORMAT} v{_VERSION} document")
            return cls(str(doc["dtype"]), tuple(int(e) for e in doc["exponents"]),
                       float(doc.get("coverage", 0.0)), int(doc.get("samples", 0)))
        except CodebookMismatch:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CodebookMismatch(f"malformed codebook JSON: {exc}") from exc


def calibrate(tensors: Iterable[torch.Tensor] | torch.Tensor) -> Codebook:
    """Codebook of the most frequent exponents over ``tensors`` (all of one dtype).

    Calibrate K and V separately (``calibrate(ks)``, ``calibrate(vs)``) for per-kind books.

    Raises:
        CodebookMismatch: no tensors, or tensors of different dtypes.
        UnsupportedTensor: a dtype the codec does not handle.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    layout: FloatLayout | None = None
    histogram = None
    for tensor in tensors:
        this = layout_for(tensor.dtype)
        if layout is None:
            layout = this
            histogram = torch.zeros(1 << layout.exp_bits, dtype=torch.int64)
        elif this is not layout:
            raise CodebookMismatch(f"calibration mixes {layout.name} and {this.name}")
        histogram += exponent_histogram(tensor, layout).cpu()
    if layout is None:
        raise CodebookMismatch("calibration needs at least one tensor")
    return Codebook.from_histogram(layout.name, histogram)
