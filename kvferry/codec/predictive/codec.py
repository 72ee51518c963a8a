"""``predictive``: the registry entry, binding, and frames assembled around the rANS coder.

A transfer codes the target's KV against a reference region holding the predictor's KV of the
same prompt (same block layout, same block ids on each side). ``bind`` checks codebook, layout and
reference once per transfer and returns the ``PredictiveBound`` that ``encode``/``decode`` and the
block functions take as their codebook. The CPU reference (numpy) defines the bytes; CUDA tensors
go through it by way of host copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..dtypes import layout_by_wire_id, layout_for
from ..errors import CodebookMismatch, CorruptFrame, OutputMismatch, UnsupportedTensor
from ..format import FrameCodec, stored_size
from ..frames import decode as decode_stored, checked_block_ids
from ..frames import encode_stored
from ..layout import BlockLayout
from ..registry import Capabilities, CodecBase, codec_id as frame_codec_id
from . import rans
from .codebook import PredictiveCodebook, calibrate_predictive
from .format import (FRAME_ID, HEADER_SIZE, REFERENCE_IDS, PredictiveHeader, lanes_for, parse_header)
from .model import Elements

NEEDS_REFERENCE = "predictive needs a reference region holding the predictor's KV"


@dataclass(frozen=True, eq=False)
class PredictiveBound:
    """A codebook bound to one region: its block layout, the reference region (the predictor's
    KV, ``[blocks, *layout.shape]``) and the per-position sigma and K/V index of one block."""

    codebook: PredictiveCodebook
    layout: BlockLayout
    reference: torch.Tensor
    sigma: np.ndarray  # float64, layout.shape
    kv: np.ndarray  # int8, layout.shape

    def elements(self, ref_blocks: torch.Tensor) -> Elements:
        """Model inputs of the elements of ``ref_blocks`` (some blocks of the reference)."""
        n = ref_blocks.shape[0]
        mu = ref_blocks.detach().to("cpu", torch.float32).numpy().astype(np.float64).reshape(-1)
        sigma = np.broadcast_to(self.sigma, (n, *self.sigma.shape)).reshape(-1)
        kv = np.broadcast_to(self.kv, (n, *self.kv.shape)).reshape(-1)
        return Elements(mu, sigma, kv, self.codebook.marginal_cdfs(), self.codebook.alphabet)


def bind(codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None, *,
         layer: int | None = None) -> PredictiveBound:
    """Bind ``codebook`` to a region of blocks named by ``layout`` and its reference region.

    ``reference`` is the region holding the predictor's KV: ``[blocks, *layout.shape]``, the dtype
    the codebook was calibrated with. The layout must name ``kv``, ``head`` and ``channel``; a
    ``layer`` axis must match the sigma table's layers, and a region without one (a per-layer
    region) names its ``layer`` here unless the table has a single layer.

    Raises:
        CodebookMismatch: not a predictive codebook, no reference, reference of the wrong shape or
            dtype, or a layout the sigma table does not fit.
    """
    if not isinstance(codebook, PredictiveCodebook):
        raise CodebookMismatch(f"predictive needs a PredictiveCodebook, got {type(codebook).__name__}")
    if reference is None:
        raise CodebookMismatch(NEEDS_REFERENCE)
    if layout is None:
        raise CodebookMismatch("predictive needs the region's block axes named (layer, kv, head, channel)")
    if not isinstance(reference, torch.Tensor):
        raise CodebookMismatch(f"the reference must be a tensor, got {type(reference).__name__}")
    ref_dtype = str(reference.dtype).removeprefix("torch.")
    if ref_dtype != codebook.reference_dtype:
        raise CodebookMismatch(f"reference is {ref_dtype}, the codebook was calibrated on a "
                               f"{codebook.reference_dtype} predictor")
    if reference.dim() != len(layout.shape) + 1 or tuple(reference.shape[1:]) != layout.shape:
        raise CodebookMismatch(f"reference of shape {list(reference.shape)} is not [blocks, *{list(layout.shape)}]")
    kv_i, head_i, chan_i = layout.require("kv", "head", "channel", codec="predictive")
    book = codebook
    if (layout.shape[head_i], layout.shape[chan_i]) != (book.heads, book.channels):
        raise CodebookMismatch(f"block has {layout.shape[head_i]} heads x {layout.shape[chan_i]} channels, "
                               f"the sigma table {book.heads} x {book.channels}")
    ndim = len(layout.shape)
    layer_i = layout.index("layer")
    if layer_i is not None:
        if layer is not None:
            raise CodebookMismatch("the block has a layer axis; layer= is for per-layer regions")
        if layout.shape[layer_i] != book.layers:
            raise CodebookMismatch(f"block has {layout.shape[layer_i]} layers, the sigma table {book.layers}")
        table = book.sigma
    else:
        if layer is None and book.layers != 1:
            raise CodebookMismatch(f"the block has no layer axis and the sigma table has {book.layers} layers: "
                                   f"name the region's layer")
        index = 0 if layer is None else layer
        if not 0 <= index < book.layers:
            raise CodebookMismatch(f"layer {index} is outside the sigma table's {book.layers} layers")
        table = book.sigma[index:index + 1]
    # sigma per position of one block: the table's axes moved to where the block has them
    src = [layer_i, kv_i, head_i, chan_i]
    sigma = table.astype(np.float64)
    if layer_i is None:
        sigma, src = sigma[0], src[1:]
    order = np.argsort(src)
    sigma = sigma.transpose(order)
    shape = [1] * ndim
    for axis in src:
        shape[axis] = layout.shape[axis]
    sigma = np.broadcast_to(sigma.reshape(shape), layout.shape).copy()
    kv = np.broadcast_to(np.arange(2, dtype=np.int8).reshape([2 if i == kv_i else 1 for i in range(ndim)]),
                         layout.shape).copy()
    return PredictiveBound(book, layout, reference, sigma, kv)


def _require_bound(bound: Any) -> PredictiveBound:
    if isinstance(bound, PredictiveBound):
        return bound
    if bound is None or isinstance(bound, PredictiveCodebook):
        raise CodebookMismatch(f"{NEEDS_REFERENCE}: pass bind(codebook, layout, reference), not "
                               f"{'nothing' if bound is None else 'the bare codebook'}")
    raise CodebookMismatch(f"predictive needs a PredictiveBound, got {type(bound).__name__}")


def _ordinals(x: torch.Tensor, bound: PredictiveBound) -> np.ndarray:
    alpha = bound.codebook.alphabet
    bits = x.detach().cpu().contiguous().view(alpha.layout.int_dtype).numpy().reshape(-1).astype(np.int64)
    return alpha.ordinal[bits & (alpha.size - 1)]


def _frame_of(x: torch.Tensor, ref: torch.Tensor, bound: PredictiveBound, checksum: bool) -> torch.Tensor:
    book = bound.codebook
    layout = layout_for(x.dtype)
    if layout.name != book.dtype:
        raise CodebookMismatch(f"codebook is for {book.dtype}, the tensor is {x.dtype}")
    numel = x.numel()
    if numel == 0:
        return encode_stored(x.cpu(), checksum=checksum).to(x.device)
    el = bound.elements(ref)
    o = _ordinals(x, bound)
    start = el.cdf_at(o)
    freq = el.cdf_at(o + 1) - start
    lanes = lanes_for(numel, float(np.sum(32.0 - np.log2(freq.astype(np.float64)))))
    states, words = rans.encode(start, freq, lanes)
    header = PredictiveHeader(layout.wire_id, REFERENCE_IDS[book.reference_dtype], tuple(x.shape), numel, lanes,
                              book.digest, int(words.size), None)
    if header.total >= stored_size(layout, numel):  # the prediction did not pay: store the bytes
        return encode_stored(x.detach().cpu(), checksum=checksum).to(x.device)
    streams = states.astype("<u8").tobytes() + words.astype("<u4").tobytes()
    if checksum:
        header = header.with_crc(crc32c(streams))
    frame = np.frombuffer(header.pack() + streams, dtype=np.uint8).copy()
    return torch.from_numpy(frame).to(x.device)


def encode(x: torch.Tensor, bound: PredictiveBound, *, checksum: bool = True) -> torch.Tensor:
    """One frame of ``x`` (the whole region: the shape of ``bound.reference``), coded against the
    reference; a stored frame (codec 0) when that would not be smaller.

    Raises:
        UnsupportedTensor: a dtype the codec does not handle.
        CodebookMismatch: not bound, a codebook for another dtype, or a reference of another shape.
    """
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    layout_for(x.dtype)
    bound = _require_bound(bound)
    if tuple(x.shape) != tuple(bound.reference.shape):
        raise CodebookMismatch(f"tensor {list(x.shape)} and reference {list(bound.reference.shape)} differ in shape")
    return _frame_of(x, bound.reference, bound, checksum)



def read_header(frame: torch.Tensor) -> PredictiveHeader:
    """Validated header of a predictive frame.

    Raises:
        CorruptFrame: not a predictive frame, or a header that fails validation.
    """
    if frame_codec_id(frame) != FRAME_ID:
        raise CorruptFrame("not a predictive frame")
    return parse_header(frame[:HEADER_SIZE].cpu().numpy().tobytes(), frame.numel())


def _decode_against(frame: torch.Tensor, header: PredictiveHeader, ref: torch.Tensor,
                    bound: PredictiveBound) -> torch.Tensor:
    book = bound.codebook
    layout = layout_by_wire_id(header.dtype_id)
    if layout is None:
        raise CorruptFrame(f"unknown dtype id {header.dtype_id}")
    if layout.name != book.dtype:
        raise CodebookMismatch(f"frame holds {layout.name}, the codebook is for {book.dtype}")
    if header.digest != book.digest:
        raise CodebookMismatch(f"frame was coded with sigma table {header.digest:016x}, this side holds "
                               f"{book.digest:016x}")
    if header.reference_dtype != book.reference_dtype:
        raise CodebookMismatch(f"frame was coded against a {header.reference_dtype} reference, the codebook's "
                               f"is {book.reference_dtype}")
    if header.shape != tuple(ref.shape):
        raise CodebookMismatch(f"frame holds {list(header.shape)}, the reference is {list(ref.shape)}")
    buf = frame.cpu().numpy()
    body = buf[HEADER_SIZE:]
    if header.stream_crc is not None and crc32c(memoryview(body)) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    states = body[:8 * header.lanes].view("<u8")
    words = body[8 * header.lanes:].view("<u4")
    ordinals = rans.decode(states, words, bound.elements(ref), header.numel)
    alpha = book.alphabet
    sym = alpha.bits_of[ordinals]
    if alpha.bits == 16:
        flat = torch.from_numpy(sym.astype(np.uint16).view(np.int16))
    else:
        flat = torch.from_numpy(sym.astype(np.uint8))
    return flat.view(layout.dtype).view(header.shape)


def decode(frame: torch.Tensor, bound: PredictiveBound, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor a frame holds (predictive or stored), on ``frame.device`` or written into
    ``out`` (same dtype and element count). Everything is checked before ``out`` is touched.

    Raises:
        CorruptFrame: the frame is malformed, truncated, or fails a checksum.
        CodebookMismatch: not bound, another sigma table, or a reference of another shape.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    codec_id = frame_codec_id(frame)
    if codec_id == int(FrameCodec.STORED):
        return decode_stored(frame, out=out)
    bound = _require_bound(bound)
    header = read_header(frame)
    layout = layout_by_wire_id(header.dtype_id)
    if out is not None and (layout is None or out.dtype != layout.dtype or out.numel() != header.numel):
        raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds dtype id {header.dtype_id}"
                             f"[{header.numel}]")
    result = _decode_against(frame, header, bound.reference, bound).to(frame.device)
    return result if out is None else out.copy_(result.view(out.shape))



def _gather(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    bits = torch.uint8 if t.element_size() == 1 else {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(bits).index_select(0, ids.to(t.device)).view(t.dtype)  # index_select lacks float8 kernels


def _check_region(cache: torch.Tensor, bound: PredictiveBound) -> None:
    if not isinstance(cache, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(cache).__name__}")
    layout_for(cache.dtype)
    if tuple(cache.shape) != tuple(bound.reference.shape):
        raise CodebookMismatch(f"region {list(cache.shape)} and its reference {list(bound.reference.shape)} "
                               f"differ in shape")


def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, bound: PredictiveBound, *,
                  checksum: bool = True) -> torch.Tensor:
    """Frame of ``cache[block_ids]`` coded against ``bound.reference[block_ids]``.

    Raises:
        CodebookMismatch: not bound, or a cache whose shape is not the reference's.
        BlockOutOfRange: a block id outside the cache.
    """
    bound = _require_bound(bound)
    _check_region(cache, bound)
    ids = checked_block_ids(block_ids, cache).cpu()
    return _frame_of(_gather(cache, ids), _gather(bound.reference, ids), bound, checksum)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  bound: PredictiveBound) -> None:
    """Write the frame's blocks into ``cache[block_ids]``, decoded against the same blocks of the
    reference; nothing is written if anything is wrong.

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        CodebookMismatch: not bound, another sigma table, a cache not shaped like the reference.
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or ids repeat.
        BlockOutOfRange: a block id outside the cache.
    """
    bound = _require_bound(bound)
    _check_region(cache, bound)
    ids = checked_block_ids(block_ids, cache, unique=True).cpu()
    expected = (ids.numel(), *cache.shape[1:])
    if frame_codec_id(frame) == int(FrameCodec.STORED):
        blocks = decode_stored(frame)
    else:
        header = read_header(frame)
        layout = layout_by_wire_id(header.dtype_id)
        if layout is None or layout.dtype != cache.dtype or header.shape != expected:
            raise OutputMismatch(f"frame holds dtype id {header.dtype_id}{list(header.shape)}, blocks need "
                                 f"{str(cache.dtype).removeprefix('torch.')}{list(expected)}")
        blocks = _decode_against(frame, header, _gather(bound.reference, ids), bound)
    if blocks.dtype != cache.dtype or tuple(blocks.shape) != expected:
        raise OutputMismatch(f"frame holds {blocks.dtype}{list(blocks.shape)}, blocks need {cache.dtype}{list(expected)}")
    bits = layout_for(cache.dtype).int_dtype
    cache.view(bits).index_copy_(0, ids.to(cache.device), blocks.to(cache.device).view(bits))


class PredictiveCodec(CodecBase):
    """Speculative KV coding: each element arithmetic-coded under a mixture centred on the
    predictor's KV (the reference region). Lossless, but not standalone: it needs the reference
    and the sigma table on both sides, so ``auto`` never picks it."""

    name = "predictive"
    frame_id = FRAME_ID
    capabilities = Capabilities(lossless=True, decode_needs_codebook=True)

    def supports(self, dtype: torch.dtype) -> bool:
        try:
            layout_for(dtype)
        except UnsupportedTensor:
            return False
        return True

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        # A predictive frame is written only if it is smaller than the stored one.
        return stored_size(layout_for(dtype), int(np.prod(tuple(shape), dtype=np.int64)))

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  predictor: torch.Tensor | Sequence[torch.Tensor] | None = None,
                  axes: Sequence[str] | None = None) -> PredictiveCodebook:
        """``calibrate_predictive(samples, predictor, axes)``; ``token_axis`` is not needed (every
        axis but layer, kv, head, channel is pooled).

        Raises:
            CodebookMismatch: no predictor samples or no axis names (the target alone says
                nothing about how well a predictor fits it).
        """
        if predictor is None or axes is None:
            raise CodebookMismatch("predictive calibrates on (target, predictor) pairs with named axes: "
                                   "calibrate(target, predictor=..., axes=(...)) or calibrate_predictive")
        return calibrate_predictive(samples, predictor, axes)

    def codebook_from_json(self, text: str | bytes) -> PredictiveCodebook:
        return PredictiveCodebook.from_json(text)

    def bind(self, codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None = None, *,
             layer: int | None = None) -> PredictiveBound:
        return bind(codebook, layout, reference, layer=layer)

    def encode(self, x: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        return encode(x, codebook)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(frame, codebook, out=out)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        return encode_blocks(cache, block_ids, codebook)

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        decode_blocks(frame, cache, block_ids, codebook)
