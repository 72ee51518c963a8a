"""Splitting float bits into exponent and residual fields, and joining them back (pure torch)."""

from __future__ import annotations

import torch

from .dtypes import FloatLayout


def as_bits(x: torch.Tensor, layout: FloatLayout) -> torch.Tensor:
    """Flat view of the element bits as a same-width integer (int16 or uint8): no copy if contiguous.

    ``split`` masks every field it extracts, so int16's sign extension never leaks into a field.
    """
    return x.reshape(-1).view(layout.int_dtype)


def split(bits: torch.Tensor, layout: FloatLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, residual) of each element, in the width of ``bits`` (uint8 for bfloat16, whose
    two fields are a byte each); residual = sign << mant_bits | mantissa."""
    m, e = layout.mant_bits, layout.exp_bits
    if layout.total_bits == 16 and e == 8:
        # Casts to uint8 keep the low byte, so each field costs one or two narrow passes.
        exponent = (bits >> m).to(torch.uint8)
        residual = ((bits >> 8).to(torch.uint8) & 0x80) | (bits.to(torch.uint8) & 0x7F)
        return exponent, residual
    exponent = (bits >> m) & ((1 << e) - 1)
    residual = (((bits >> (e + m)) & 1) << m) | (bits & ((1 << m) - 1))
    return exponent, residual


def join(exponent: torch.Tensor, residual: torch.Tensor, layout: FloatLayout) -> torch.Tensor:
    """Inverse of ``split``: int32 element bits."""
    exponent, residual = exponent.to(torch.int32), residual.to(torch.int32)
    m, e = layout.mant_bits, layout.exp_bits
    return ((residual >> m) << (e + m)) | (exponent << m) | (residual & ((1 << m) - 1))


def from_bits(bits: torch.Tensor, layout: FloatLayout) -> torch.Tensor:
    """Flat tensor of ``layout.dtype`` from int32 element bits."""
    if layout.total_bits == 16:
        return bits.to(torch.int16).view(layout.dtype)  # int32 -> int16 keeps the low 16 bits
    return bits.to(torch.uint8).view(layout.dtype)


def exponent_histogram(x: torch.Tensor, layout: FloatLayout) -> torch.Tensor:
    """Count of each exponent value in ``x``, on x's device."""
    exponent, _ = split(as_bits(x, layout), layout)
    return torch.bincount(exponent, minlength=1 << layout.exp_bits)  # any integer dtype; no int64 copy
