"""Bit layouts of the float formats the codec splits into exponent and residual."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedTensor


@dataclass(frozen=True)
class FloatLayout:
    """How one float format splits: ``sign | exponent | mantissa``.

    The *residual* is the element with its exponent field removed, ``sign << mant_bits | mantissa``;
    it is stored exactly. The exponent is coded with ``code_bits``-bit codes from a top-2**code_bits
    codebook.
    """

    dtype: torch.dtype
    name: str
    wire_id: int
    total_bits: int
    exp_bits: int
    code_bits: int

    @property
    def mant_bits(self) -> int:
        return self.total_bits - 1 - self.exp_bits

    @property
    def residual_bits(self) -> int:
        return self.total_bits - self.exp_bits

    @property
    def codebook_size(self) -> int:
        return 1 << self.code_bits

    @property
    def itemsize(self) -> int:
        return self.total_bits // 8

    @property
    def int_dtype(self) -> torch.dtype:
        """Same-width integer dtype used to view the bits."""
        return torch.int16 if self.total_bits == 16 else torch.uint8


LAYOUTS: tuple[FloatLayout, ...] = (
    FloatLayout(torch.bfloat16, "bfloat16", 1, 16, 8, 4),
    FloatLayout(torch.float16, "float16", 2, 16, 5, 4),
    FloatLayout(torch.float8_e5m2, "float8_e5m2", 3, 8, 5, 4),
    # A 4-bit code saves nothing on a 4-bit exponent, so E4M3 gets the top-8, 3-bit code.
    FloatLayout(torch.float8_e4m3fn, "float8_e4m3fn", 4, 8, 4, 3),
)
_BY_DTYPE = {layout.dtype: layout for layout in LAYOUTS}
_BY_NAME = {layout.name: layout for layout in LAYOUTS}
_BY_WIRE_ID = {layout.wire_id: layout for layout in LAYOUTS}


def layout_for(dtype: torch.dtype) -> FloatLayout:
    """Layout of a torch dtype.

    Raises:
        UnsupportedTensor: the dtype is not one of bf16, fp16, fp8 e5m2, fp8 e4m3fn.
    """
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        supported = ", ".join(sorted(_BY_NAME))
        raise UnsupportedTensor(f"dtype {dtype} is not supported (supported: {supported})") from None


def supported(dtype: torch.dtype) -> bool:
    """Whether the codecs' float layouts cover ``dtype``."""
    return any(layout.dtype == dtype for layout in LAYOUTS)


def layout_by_name(name: str) -> FloatLayout:
    """Layout from torch's dtype name (``"bfloat16"``, ``"float8_e5m2"``, ...).

    Raises:
        UnsupportedTensor: unknown name.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        supported = ", ".join(sorted(_BY_NAME))
        raise UnsupportedTensor(f"dtype {name!r} is not supported (supported: {supported})") from None


def layout_by_wire_id(wire_id: int) -> FloatLayout | None:
    """Layout for a frame header's dtype id, or None if the id is unknown."""
    return _BY_WIRE_ID.get(wire_id)
