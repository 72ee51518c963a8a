"""SplitZip streams in pure torch: the reference that defines the bytes (runs on any device).

Encode splits each element into an exact residual (sign and mantissa) and an exponent, maps the
exponent through the codebook to a fixed-width code, and records exponents outside the codebook
as escapes: per-chunk counts, chunk-local uint16 positions and raw uint8 exponents. Escaped
elements carry code 0 in the dense stream; decode looks every code up, then overwrites escapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import bitpack
from .dtypes import FloatLayout
from .errors import CorruptFrame
from .fields import join


@dataclass(frozen=True)
class Escapes:
    """Escaped elements: flat index, chunk-local position and raw exponent, in element order."""

    index: torch.Tensor
    counts: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor


def marked_codes(exponent: torch.Tensor, codebook: tuple[int, ...], layout: FloatLayout) -> torch.Tensor:
    """Code of each element through a *marked* table: exponents outside the codebook map to
    ``codebook_size``, so one lookup yields both the code (``& (size - 1)``, escapes get 0) and
    the escape flag (``== size``)."""
    size = layout.codebook_size
    table = torch.full((1 << layout.exp_bits,), size, dtype=torch.uint8)
    table[torch.tensor(codebook, dtype=torch.int64)] = torch.arange(size, dtype=torch.uint8)
    return table.to(exponent.device)[exponent.to(torch.int64)]


def find_escapes(exponent: torch.Tensor, marked: torch.Tensor, chunk: int, layout: FloatLayout) -> Escapes:
    index = torch.nonzero(marked == layout.codebook_size).view(-1)
    chunk_id = index // chunk
    chunks = (exponent.numel() + chunk - 1) // chunk
    counts = torch.bincount(chunk_id, minlength=chunks)
    return Escapes(index, counts, index - chunk_id * chunk, exponent[index])


def encode_streams(residual: torch.Tensor, marked: torch.Tensor, escapes: Escapes,
                   layout: FloatLayout) -> list[torch.Tensor]:
    """The five SplitZip streams as uint8 tensors, in frame order."""
    codes = marked & (layout.codebook_size - 1)
    return [
        bitpack.pack(residual, layout.residual_bits),
        bitpack.pack(codes, layout.code_bits),
        _u16_le(escapes.counts),
        _u16_le(escapes.positions),
        escapes.values.to(torch.uint8),
    ]


def read_escapes(counts_stream: torch.Tensor, positions_stream: torch.Tensor, values_stream: torch.Tensor,
                 numel: int, chunk: int, total: int, layout: FloatLayout) -> Escapes:
    """Parse and validate the escape streams before anything is written.

    Raises:
        CorruptFrame: counts exceed their chunk or disagree with the header's total, a position is
            outside its chunk or not increasing, or a raw exponent does not fit the exponent field.
    """
    device = counts_stream.device
    counts = _read_u16_le(counts_stream).to(torch.int64)
    chunks = counts.numel()
    chunk_len = torch.full((chunks,), chunk, dtype=torch.int64, device=device)
    if chunks:
        chunk_len[-1] = numel - (chunks - 1) * chunk
    if chunks and bool((counts > chunk_len).any()):
        raise CorruptFrame("a chunk's escape count exceeds the chunk's size")
    if int(counts.sum()) != total:
        raise CorruptFrame(f"chunk escape counts sum to {int(counts.sum())}, header says {total}")
    chunk_id = torch.repeat_interleave(torch.arange(chunks, device=device), counts)
    positions = _read_u16_le(positions_stream).to(torch.int64)
    if total and bool((positions >= chunk_len[chunk_id]).any()):
        raise CorruptFrame("an escape position lies outside its chunk")
    if total > 1:
        same_chunk = chunk_id[1:] == chunk_id[:-1]
        if bool((same_chunk & (positions[1:] <= positions[:-1])).any()):
            raise CorruptFrame("escape positions within a chunk are not strictly increasing")
    values = values_stream.to(torch.int32)
    if total and bool((values >= 1 << layout.exp_bits).any()):
        raise CorruptFrame(f"an escape exponent does not fit {layout.exp_bits} bits")
    return Escapes(chunk_id * chunk + positions, counts, positions, values)


def decode_bits(residual_stream: torch.Tensor, codes_stream: torch.Tensor, escapes: Escapes,
                codebook: tuple[int, ...], numel: int, layout: FloatLayout) -> torch.Tensor:
    """Element bits (int32) from validated streams."""
    device = codes_stream.device
    table = torch.tensor(codebook, dtype=torch.int32, device=device)
    exponent = table[bitpack.unpack(codes_stream, numel, layout.code_bits).long()]
    exponent[escapes.index] = escapes.values
    residual = bitpack.unpack(residual_stream, numel, layout.residual_bits)
    return join(exponent, residual, layout)


def _u16_le(values: torch.Tensor) -> torch.Tensor:
    v = values.to(torch.int32)
    return torch.stack([v & 0xFF, v >> 8], dim=1).view(-1).to(torch.uint8)


def _read_u16_le(stream: torch.Tensor) -> torch.Tensor:
    s = stream.to(torch.int32)
    return s[0::2] | (s[1::2] << 8)
