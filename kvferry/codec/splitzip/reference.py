"""SplitZip streams in pure torch: the reference that defines the bytes (runs on any device).

Encode splits each element into an exact residual (sign and mantissa) and an exponent, maps the
exponent through the codebook to a fixed-width code, and records exponents outside the codebook
as escapes: per-chunk counts, chunk-local uint16 positions and raw uint8 exponents. Escaped
elements carry code 0 in the dense stream; decode looks every code up, then overwrites escapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import bitpack
from ..dtypes import FloatLayout
from ..errors import CorruptFrame
from ..fields import from_bits, join


@dataclass(frozen=True)
class Escapes:
    """Escaped elements: flat index, chunk-local position and raw exponent, in element order."""

    index: torch.Tensor
    counts: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor


@functools.lru_cache(maxsize=32)
def _pair_exponents(codebook: tuple[int, ...]) -> torch.Tensor:
    """int16 by byte value: the exponents of its low and high 4-bit code as the low and high
    byte, so the gathered int16s viewed as bytes are the exponents in element order."""
    book = torch.tensor(codebook, dtype=torch.uint8)
    byte = torch.arange(256)
    return torch.stack([book[byte & 15], book[byte >> 4]], dim=1).contiguous().view(torch.int16).view(-1)


@functools.lru_cache(maxsize=32)
def _bf16_exponent_pairs(codebook: tuple[int, ...]) -> torch.Tensor:
    """int32 by code byte: the exponent bits (``e << 7``) of its two elements as the low and
    high int16, so gathered int32s viewed as int16 are bfloat16 bits with a zero residual."""
    book = torch.tensor(codebook, dtype=torch.int32)
    byte = torch.arange(256)
    return (book[byte & 15] << 7) | (book[byte >> 4] << 23)


@functools.lru_cache(maxsize=1)
def _bf16_residual_pairs() -> torch.Tensor:
    """int32 by residual byte pair ``r0 | r1 << 8``: the bits (sign << 15 | mantissa) each
    residual byte contributes to its bfloat16, as the low and high int16."""
    byte = torch.arange(256, dtype=torch.int32)
    bits = ((byte & 0x80) << 8) | (byte & 0x7F)
    pair = torch.arange(1 << 16, dtype=torch.int32)
    return bits[pair & 0xFF] | (bits[pair >> 8] << 16)


@functools.lru_cache(maxsize=32)
def _pair_codes(codebook: tuple[int, ...], size: int) -> torch.Tensor:
    """int16 by exponent pair ``e0 | e1 << 8``: low byte the packed code byte (escapes coded 0),
    bits 8 and 9 whether e0 or e1 escapes — one lookup per output byte for 4-bit codes."""
    marked = torch.full((256,), size, dtype=torch.int32)
    marked[torch.tensor(codebook, dtype=torch.int64)] = torch.arange(size, dtype=torch.int32)
    pair = torch.arange(1 << 16)
    first, second = marked[pair & 0xFF], marked[pair >> 8]
    codes = (first & (size - 1)) | ((second & (size - 1)) << 4)
    flags = (first == size).to(torch.int32) | ((second == size).to(torch.int32) << 1)
    return (codes | (flags << 8)).to(torch.int16)


def pair_encode(exponent: torch.Tensor, codebook: tuple[int, ...], chunk: int, layout: FloatLayout
                ) -> tuple[torch.Tensor, Escapes]:
    """Packed 4-bit code stream and escapes in one table lookup per pair of elements."""
    n = exponent.numel()
    exps = exponent.to(torch.uint8)
    if n % 2:  # pad with the exponent of code 0: a zero high nibble and no escape
        exps = torch.cat([exps, exps.new_full((1,), codebook[0])])
    # index_select with int32 indices: several times faster than int64 advanced indexing.
    index = exps.view(torch.int16).to(torch.int32) & 0xFFFF
    looked_up = torch.index_select(_pair_codes(codebook, layout.codebook_size).to(exponent.device), 0, index)
    codes = looked_up.to(torch.uint8)  # low byte: the packed codes
    flags = (looked_up >> 8) & 3
    pairs = torch.nonzero(flags).view(-1)
    pair_flags = flags[pairs]
    index = torch.cat([2 * pairs[(pair_flags & 1).bool()], 2 * pairs[(pair_flags & 2).bool()] + 1]).sort().values
    chunk_id = index // chunk
    counts = torch.bincount(chunk_id, minlength=(n + chunk - 1) // chunk)
    return codes, Escapes(index, counts, index - chunk_id * chunk, exponent[index])


def marked_codes(exponent: torch.Tensor, codebook: tuple[int, ...], layout: FloatLayout) -> torch.Tensor:
    """Code of each element through a *marked* table: exponents outside the codebook map to
    ``codebook_size``, so one lookup yields both the code (``& (size - 1)``, escapes get 0) and
    the escape flag (``== size``)."""
    size = layout.codebook_size
    table = torch.full((1 << layout.exp_bits,), size, dtype=torch.uint8)
    table[torch.tensor(codebook, dtype=torch.int64)] = torch.arange(size, dtype=torch.uint8)
    return torch.index_select(table.to(exponent.device), 0, exponent.to(torch.int32))


def find_escapes(exponent: torch.Tensor, marked: torch.Tensor, chunk: int, layout: FloatLayout) -> Escapes:
    index = torch.nonzero(marked == layout.codebook_size).view(-1)
    chunk_id = index // chunk
    chunks = (exponent.numel() + chunk - 1) // chunk
    counts = torch.bincount(chunk_id, minlength=chunks)
    return Escapes(index, counts, index - chunk_id * chunk, exponent[index])


def encode_streams(residual: torch.Tensor, codes: torch.Tensor, escapes: Escapes,
                   layout: FloatLayout) -> list[torch.Tensor]:
    """The five SplitZip streams as uint8 tensors, in frame order (``codes`` already packed)."""
    return [
        bitpack.pack(residual, layout.residual_bits),
        codes,
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


def decode_elements(residual_stream: torch.Tensor, codes_stream: torch.Tensor, escapes: Escapes,
                    codebook: tuple[int, ...], numel: int, layout: FloatLayout) -> torch.Tensor:
    """The flat tensor of ``layout.dtype`` from validated streams."""
    device = codes_stream.device
    if layout.total_bits == 16 and layout.exp_bits == 8:
        return _decode_bf16(residual_stream, codes_stream, escapes, codebook, numel)
    if layout.code_bits == 4:
        # One lookup per byte: a 256-row table gives both exponents of the two codes it holds.
        pairs = torch.index_select(_pair_exponents(codebook).to(device), 0, codes_stream.to(torch.int32))
        exponent = pairs.view(torch.uint8)[:numel]
    else:
        table = torch.tensor(codebook, dtype=torch.int32, device=device)
        exponent = torch.index_select(table, 0, bitpack.unpack(codes_stream, numel, layout.code_bits))
    exponent[escapes.index] = escapes.values.to(exponent.dtype)
    residual = bitpack.unpack(residual_stream, numel, layout.residual_bits)
    return from_bits(join(exponent, residual, layout), layout)


def _decode_bf16(residual_stream: torch.Tensor, codes_stream: torch.Tensor, escapes: Escapes,
                 codebook: tuple[int, ...], numel: int) -> torch.Tensor:
    """bfloat16 two elements at a time: one lookup per code byte gives both exponents' bits,
    one per residual byte pair gives both signs and mantissas, an OR joins them."""
    device = codes_stream.device
    pairs = (numel + 1) // 2
    residual = residual_stream[:numel]
    if numel % 2:
        residual = torch.cat([residual, residual.new_zeros(1)])
    exponent_bits = torch.index_select(_bf16_exponent_pairs(codebook).to(device), 0,
                                       codes_stream[:pairs].to(torch.int32))
    residual_index = residual.view(torch.int16).to(torch.int32) & 0xFFFF
    residual_bits = torch.index_select(_bf16_residual_pairs().to(device), 0, residual_index)
    bits = (exponent_bits | residual_bits).view(torch.int16)[:numel]
    if escapes.index.numel():
        kept = bits[escapes.index] & ~(0xFF << 7)  # sign and mantissa; the exponent comes from the escape
        bits[escapes.index] = kept | (escapes.values.to(torch.int16) << 7)
    return bits.view(torch.bfloat16)


def _u16_le(values: torch.Tensor) -> torch.Tensor:
    v = values.to(torch.int32)
    return torch.stack([v & 0xFF, v >> 8], dim=1).view(-1).to(torch.uint8)


def _read_u16_le(stream: torch.Tensor) -> torch.Tensor:
    s = stream.to(torch.int32)
    return s[0::2] | (s[1::2] << 8)
