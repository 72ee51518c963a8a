"""``lowrank``: the registry entry, binding to a block layout, frames assembled and taken apart.

CPU tensors go through the numpy reference (``reference.py``), CUDA tensors through the Triton
kernels (``gpu.py``) when Triton is there, otherwise through the reference by way of host copies.
Either way the bytes and the reconstruction are the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..dtypes import FloatLayout, layout_for
from ..frames import checked_block_ids
from ..errors import CodebookMismatch, CorruptFrame, OutputMismatch, UnsupportedTensor
from ..layout import BlockLayout
from .. import prefix
from ..registry import Capabilities, CodecBase
from . import reference
from .codebook import LowRankCodebook, calibrate
from .format import (FRAME_ID, HEADER_SIZE, MAX_NDIM, SUPPORTED_DTYPES, LowRankHeader, parse_header)
from .reference import Plan, plan


@dataclass(frozen=True)
class LowRankBinding:
    """A codebook bound to a region's block layout: what ``encode_blocks``/``decode_blocks`` take.
    Positions are of the block's own dimensions (the block axis, dim 0 of the cache, excluded)."""

    codebook: LowRankCodebook
    layout: BlockLayout
    layer: int | None
    kv: int
    head: int
    channel: int

    def positions(self) -> tuple[int | None, int, int, int]:
        """Axis positions in a stack of blocks (``[blocks, *block]``)."""
        return (None if self.layer is None else self.layer + 1, self.kv + 1, self.head + 1, self.channel + 1)


def bind(codebook: Any, layout: BlockLayout | None, reference_region: torch.Tensor | None = None) -> Any:
    """Check ``codebook`` against the region's block layout once, before anything is sent.

    Raises:
        CodebookMismatch: not a lowrank codebook, a layout without kv/head/channel axes, sizes
            that differ from the codebook's (layers, heads, head dim), or a reference region.
    """
    if reference_region is not None:
        raise CodebookMismatch("lowrank codes without a reference region")
    if isinstance(codebook, LowRankBinding):
        codebook = codebook.codebook
    if not isinstance(codebook, LowRankCodebook):
        raise CodebookMismatch(f"the lowrank codec needs a LowRankCodebook, got {type(codebook).__name__}")
    if layout is None:
        if codebook.pooled:
            return codebook  # one group: any tensor's last axis is the channel
        raise CodebookMismatch("lowrank needs the block layout (axes kv, head, channel) to bind a per-head "
                               "codebook; name the region's axes")
    kv, head, channel = layout.require("kv", "head", "channel", codec="lowrank")
    layer = layout.index("layer")
    layers, kvs, heads, d = codebook.dims
    got = (layout.size("layer"), layout.size("kv"), layout.size("head"), layout.size("channel"))
    if got != codebook.dims:
        raise CodebookMismatch(f"block layout {dict(zip(layout.axes, layout.shape))} has (layers, kv, heads, "
                               f"head dim) {got}; the codebook was calibrated for {codebook.dims}")
    return LowRankBinding(codebook, layout, layer, kv, head, channel)


def _book_of(codebook: Any) -> LowRankCodebook:
    if isinstance(codebook, LowRankBinding):
        return codebook.codebook
    if isinstance(codebook, LowRankCodebook):
        return codebook
    if codebook is None:
        raise CodebookMismatch("lowrank needs its codebook (calibrate one; the receiver needs the same)")
    raise CodebookMismatch(f"the lowrank codec needs a LowRankCodebook, got {type(codebook).__name__}")


def _check_tensor(x: torch.Tensor) -> FloatLayout:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    layout = layout_for(x.dtype)
    if layout.name not in SUPPORTED_DTYPES:
        raise UnsupportedTensor(f"lowrank codes bfloat16 and float16, not {layout.name}")
    if not 1 <= x.dim() <= MAX_NDIM:
        raise UnsupportedTensor(f"lowrank codes tensors of 1..{MAX_NDIM} dimensions, not {x.dim()}")
    return layout


def _plan_for(shape: tuple[int, ...], codebook: Any) -> tuple[LowRankCodebook, Plan]:
    book = _book_of(codebook)
    if isinstance(codebook, LowRankBinding):
        if tuple(shape[1:]) != codebook.layout.shape:
            raise CodebookMismatch(f"blocks of shape {list(shape[1:])}; the codebook is bound to "
                                   f"{list(codebook.layout.shape)}")
        positions = codebook.positions()
    elif book.pooled:
        positions = (None, None, None, len(shape) - 1)
        if shape[-1] != book.channels:
            raise CodebookMismatch(f"last axis of {shape[-1]}; the codebook's head dim is {book.channels}")
    else:
        raise CodebookMismatch("a per-head lowrank codebook codes blocks of a layout: bind it first "
                               "(codec.bind(codebook, layout))")
    return book, plan(tuple(shape), positions)


def encode(x: torch.Tensor, codebook: Any) -> torch.Tensor:
    """One lowrank frame of ``x`` on ``x.device``: a stack of blocks for a bound codebook, any
    tensor (last axis = channel) for a codebook calibrated without axes.

    Raises:
        UnsupportedTensor: a dtype other than bfloat16/float16.
        CodebookMismatch: no codebook, or one that does not fit ``x``.
    """
    layout = _check_tensor(x)
    book, p = _plan_for(tuple(x.shape), codebook)
    xg = x.detach().permute(p.perm).reshape(p.groups, p.vectors, p.channels)
    if x.is_cuda:
        from . import gpu

        if gpu.available():
            params, coefs = gpu.encode_streams(xg, book)
            return _assemble_device(_header(layout, p, book), params, coefs)
    params, coefs = reference.encode_streams(xg.cpu().float().numpy(), book)
    return _assemble(_header(layout, p, book), params, coefs).to(x.device)


def encode_reference(x: torch.Tensor, codebook: Any) -> torch.Tensor:
    """The frame as the reference writes it (CPU tensor in, CPU frame out)."""
    return encode(x.detach().cpu(), codebook)


def _header(layout: FloatLayout, p: Plan, book: LowRankCodebook) -> LowRankHeader:
    return LowRankHeader(layout, p.shape, p.positions, book.dims, book.quantize is not None, book.digest(),
                         p.vectors, reference.stream_lengths(book, p.vectors), 0)


def _assemble(header: LowRankHeader, params: bytes, coefs: bytes) -> torch.Tensor:
    assert (len(params), len(coefs)) == header.lengths, (header.lengths, len(params), len(coefs))
    body = params + coefs
    return torch.frombuffer(bytearray(header.with_crc(crc32c(body)).pack() + body), dtype=torch.uint8)


def _assemble_device(header: LowRankHeader, params: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    assert (params.numel(), coefs.numel()) == header.lengths
    frame = torch.empty(header.total, dtype=torch.uint8, device=coefs.device)
    frame[HEADER_SIZE:HEADER_SIZE + params.numel()] = params
    frame[HEADER_SIZE + params.numel():] = coefs
    # The stream CRC is taken on a host copy (a GPU CRC32C is still to come, as for entropy).
    crc = crc32c(memoryview(frame[HEADER_SIZE:].cpu().numpy()))
    frame[:HEADER_SIZE] = torch.frombuffer(bytearray(header.with_crc(crc).pack()), dtype=torch.uint8).to(frame.device)
    return frame


def read_header(frame: torch.Tensor) -> LowRankHeader:
    """Validated header of a lowrank frame.

    Raises:
        CorruptFrame: not a lowrank frame, or a header that fails validation.
    """
    prefix.check_frame(frame)
    head = frame[:HEADER_SIZE].cpu().numpy().tobytes()
    if prefix.codec_id(head) != FRAME_ID:
        raise CorruptFrame(f"codec id {head[prefix.CODEC_ID_AT]} is not the lowrank codec's {FRAME_ID}")
    return parse_header(head, frame.numel())


def _validate(frame: torch.Tensor, codebook: Any) -> tuple[LowRankHeader, LowRankCodebook, np.ndarray]:
    """Header, codebook and the frame's streams as host bytes, everything checked.

    Raises:
        CorruptFrame: bad header, lengths, checksum or padding.
        CodebookMismatch: the frame was written with another codebook.
    """
    header = read_header(frame)
    book = _book_of(codebook)
    if header.digest != book.digest():
        raise CodebookMismatch(f"frame was written with codebook {header.digest.hex()}, this one is "
                               f"{book.digest().hex()}")
    if header.dims != book.dims or header.quantized != (book.quantize is not None):
        raise CorruptFrame("frame's dims or quantizer disagree with its codebook's")
    if header.lengths != reference.stream_lengths(book, header.vectors):
        raise CorruptFrame(f"stream lengths {header.lengths} disagree with the codebook's ranks")
    body = frame[HEADER_SIZE:].cpu().numpy()
    if crc32c(memoryview(body)) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    if book.quantize is not None:
        _check_code_padding(body[header.lengths[0]:], book, header.vectors)
    return header, book, body


def _check_code_padding(codes: np.ndarray, book: LowRankCodebook, vectors: int) -> None:
    pos = 0
    for r, b in zip(book.ranks.tolist(), book.bits().tolist()):
        nb = reference.code_bytes(r, b)
        if b == 4 and r % 2 and vectors:
            last = codes[pos:pos + nb * vectors].reshape(vectors, nb)[:, -1]
            if (last >> 4).any():
                raise CorruptFrame("unused high nibble of a 4-bit code byte is not zero")
        pos += nb * vectors


def _reconstruct(frame: torch.Tensor, header: LowRankHeader, book: LowRankCodebook, body: np.ndarray) -> torch.Tensor:
    p = plan(header.shape, header.positions)
    dtype = header.layout.dtype
    if frame.is_cuda:
        from . import gpu

        if gpu.available():
            streams = frame[HEADER_SIZE:]
            yg = gpu.decode_streams(streams[:header.lengths[0]], streams[header.lengths[0]:], book,
                                    header.vectors, dtype)
            return _unpermute(yg, p)
    coef = reference.coefficients(body[:header.lengths[0]], body[header.lengths[0]:], book, header.vectors)
    bits = reference.to_dtype_bits(reference.reconstruct(coef, book), header.layout.name)
    yg = torch.from_numpy(bits.view(np.int16)).view(dtype)
    return _unpermute(yg, p).to(frame.device)


def _unpermute(yg: torch.Tensor, p: Plan) -> torch.Tensor:
    inverse = [0] * len(p.perm)
    for i, d in enumerate(p.perm):
        inverse[d] = i
    return yg.reshape(p.permuted_shape).permute(inverse).contiguous()


def decode(frame: torch.Tensor, codebook: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reconstruction a frame holds, on ``frame.device`` (into ``out`` if given: same dtype and
    element count). Everything is checked before ``out`` is touched.

    Raises:
        CorruptFrame: the frame is malformed, truncated, or fails a checksum.
        CodebookMismatch: the frame was written with another codebook (or none is given).
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    header, book, body = _validate(frame, codebook)
    if out is not None and (out.dtype != header.layout.dtype or out.numel() != header.numel):
        raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds {header.layout.name}[{header.numel}]")
    result = _reconstruct(frame, header, book, body)
    return result if out is None else out.copy_(result.view(out.shape))



def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codebook: Any) -> torch.Tensor:
    """Frame of ``cache[block_ids]`` (blocks along dim 0): the same bytes as ``encode`` of them."""
    _check_tensor(cache)
    ids = checked_block_ids(block_ids, cache)
    blocks = cache.view(torch.int16).index_select(0, ids).view(cache.dtype)
    return encode(blocks, codebook)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  codebook: Any) -> None:
    """Write the frame's blocks' reconstruction into ``cache[block_ids]``; nothing is written if
    the frame is bad.

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        CodebookMismatch: the frame was written with another codebook (nothing written).
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or ids repeat.
        BlockOutOfRange: a block id outside the cache.
    """
    _check_tensor(cache)
    ids = checked_block_ids(block_ids, cache, unique=True)
    expected = (ids.numel(), *cache.shape[1:])
    header, book, body = _validate(frame, codebook)
    if header.layout.dtype != cache.dtype or header.shape != expected:
        raise OutputMismatch(f"frame holds {header.layout.name}{list(header.shape)}, blocks need "
                             f"{str(cache.dtype).removeprefix('torch.')}{list(expected)}")
    blocks = _reconstruct(frame, header, book, body)
    cache.view(torch.int16).index_copy_(0, ids, blocks.to(cache.device).view(torch.int16))


class LowRankCodec(CodecBase):
    """ZACK-style low-rank projection per (layer, K/V, head): lossy, so never ``auto``'s pick;
    the receiver must hold the sender's codebook (frames name it by digest)."""

    name = "lowrank"
    frame_id = FRAME_ID
    capabilities = Capabilities(decode_needs_codebook=True)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float16)

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        # Worst case over codebooks: full rank, bf16 coefficients (2 bytes per element). A
        # quantized vector takes at most d + 4 <= 2d bytes (head dims are at least 4).
        return HEADER_SIZE + 2 * int(np.prod(tuple(shape), dtype=np.int64))

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None, energy: float = 0.99, rank_budget: int | None = None,
                  quantize: str | None = None, center: bool = True) -> LowRankCodebook:
        return calibrate(samples, token_axis=token_axis, axes=axes, energy=energy, rank_budget=rank_budget,
                         quantize=quantize, center=center)

    def codebook_from_json(self, text: str | bytes) -> LowRankCodebook:
        return LowRankCodebook.from_json(text)

    def bind(self, codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None = None) -> Any:
        return bind(codebook, layout, reference)

    def encode(self, x: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        return encode(x, codebook)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(frame, codebook, out=out)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        return encode_blocks(cache, block_ids, codebook)

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        decode_blocks(frame, cache, block_ids, codebook)
