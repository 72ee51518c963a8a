"""``raw``: blocks as they are, in a stored frame (codec id 0): a header says what the bytes
are, so a receiver checks dtype, shape and size before it writes anything."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .checksum import crc32c
from .dtypes import layout_by_name, layout_for, supported
from .errors import BlockOutOfRange, CodebookMismatch, CorruptFrame, OutputMismatch
from .format import HEADER_SIZE, FrameCodec, make_header, parse_header, stored_size
from .frames import decode, encode_stored, read_header
from .registry import Capabilities, PositionFree
from .staging import Pending


@functools.lru_cache(maxsize=256)
def _stored_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """Header bytes of a stored frame (the same for every frame of a shape: cached)."""
    return make_header(FrameCodec.STORED, layout_by_name(dtype), shape, 0, (), 0).pack()


_NUMPY_BITS = {1: np.uint8, 2: np.int16}


def _bits(cache: torch.Tensor, layout: Any) -> np.ndarray:
    """A host tensor's elements as numpy integers of the same width (numpy has no bfloat16 or float8)."""
    return cache.view(layout.int_dtype).numpy()


def _host_ids(block_ids: torch.Tensor, cache: torch.Tensor) -> np.ndarray:
    """Host block ids as numpy indices, range-checked: numpy would wrap a negative one around.

    Raises:
        BlockOutOfRange: an id outside the cache.
    """
    ids = block_ids.numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= cache.shape[0]):
        raise BlockOutOfRange(f"block ids must be in 0..{cache.shape[0] - 1}")
    return ids


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


@dataclasses.dataclass(frozen=True)
class RawCodebook:
    """``raw`` learns nothing; its codebook exists so every codec's ``calibrate`` returns one."""

    def to_json(self) -> str:
        return json.dumps({"format": "kvferry-codebook", "version": 1, "codec": "raw"})

    @classmethod
    def from_json(cls, text: str | bytes) -> RawCodebook:
        """Raises: CodebookMismatch: not a raw codebook document."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise CodebookMismatch(f"malformed codebook JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != "kvferry-codebook" or doc.get("codec") != "raw":
            raise CodebookMismatch("not a raw codebook document")
        return cls()


class RawCodec(PositionFree):
    """The identity codec: a copy of the blocks behind a 160-byte header."""

    name = "raw"
    frame_id = int(FrameCodec.STORED)
    # Blocks go as they are, so a same-host write may replace its frames.
    capabilities = Capabilities(lossless=True, standalone=True, identity=True, starts_blocks=True)

    def supports(self, dtype: torch.dtype) -> bool:
        return supported(dtype)

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        numel = 1
        for dim in shape:
            numel *= dim
        return stored_size(layout_for(dtype), numel)

    def calibrate(self, samples: Any, *, token_axis: int | None = None, axes: Sequence[str] | None = None) -> RawCodebook:
        return RawCodebook()

    def codebook_from_json(self, text: str | bytes) -> RawCodebook:
        return RawCodebook.from_json(text)

    def encode(self, x: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        return encode_stored(x)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if read_header(frame).codec != FrameCodec.STORED:
            raise CorruptFrame("not a stored frame")
        return decode(frame, out=out)

    def start_encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[torch.Tensor]:
        frame = self.encode_blocks(cache, block_ids)
        return Pending.after(frame, frame.device) if frame.is_cuda else Pending.done(frame)

    def start_decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[None]:
        """The header is checked on the host first (it decides whether anything is written);
        the copy into the blocks is what runs on."""
        self.decode_blocks(frame, cache, block_ids)
        return Pending.after(None, cache.device) if cache.is_cuda else Pending.done(None)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        layout = layout_for(cache.dtype)
        shape = (int(block_ids.numel()), *cache.shape[1:])
        header = _stored_header(layout.name, shape)
        if not cache.is_cuda:  # the same bytes through numpy: a small chunk costs half the time
            frame = np.empty(HEADER_SIZE + _numel(shape) * layout.itemsize, dtype=np.uint8)
            frame[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
            body = frame[HEADER_SIZE:].view(_NUMPY_BITS[layout.itemsize]).reshape(shape)
            np.take(_bits(cache, layout), _host_ids(block_ids, cache), axis=0, out=body)
            return torch.from_numpy(frame)
        frame = torch.empty(HEADER_SIZE + _numel(shape) * layout.itemsize, dtype=torch.uint8, device=cache.device)
        frame[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8), non_blocking=True)
        body = frame[HEADER_SIZE:].view(layout.int_dtype).view(shape)
        torch.index_select(cache.view(layout.int_dtype), 0, block_ids, out=body)
        return frame

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        if frame.dtype != torch.uint8 or frame.dim() != 1:
            raise CorruptFrame("a frame is a 1-D torch.uint8 tensor")
        layout = layout_for(cache.dtype)
        expected = (int(block_ids.numel()), *cache.shape[1:])
        raw = frame[:HEADER_SIZE].cpu().numpy().tobytes()
        # The usual header for these blocks, byte for byte: comparing is validating.
        if raw != _stored_header(layout.name, expected) or frame.numel() != HEADER_SIZE + _numel(expected) * layout.itemsize:
            header = parse_header(raw, frame.numel())  # raises CorruptFrame with the reason
            if header.codec != FrameCodec.STORED:
                raise CorruptFrame(f"a raw transfer carried a codec {int(header.codec)} frame")
            differ = [name for name, got, need in (("dtype", header.layout.name, layout.name),
                                                   ("shape", header.shape, expected)) if got != need]
            if differ:
                verb = "differs" if len(differ) == 1 else "differ"
                raise OutputMismatch(f"frame holds {header.layout.name}{list(header.shape)}, blocks need "
                                     f"{layout.name}{list(expected)}: {' and '.join(differ)} {verb}")
            # The only other valid header for them carries a stream checksum (as the other codecs'
            # stored frames may): checked before anything is written.
            if crc32c(frame[HEADER_SIZE:].cpu().numpy().data) != header.stream_crc:
                raise CorruptFrame("stream checksum mismatch")
        if not cache.is_cuda and not frame.is_cuda:
            body = frame[HEADER_SIZE:].numpy().view(_NUMPY_BITS[layout.itemsize]).reshape(expected)
            _bits(cache, layout)[_host_ids(block_ids, cache)] = body
            return
        if not cache.is_cuda:  # a GPU frame into host blocks (CUDA caches' ids are the engine's, resolved)
            _host_ids(block_ids, cache)
        body = frame[HEADER_SIZE:].view(layout.int_dtype).view(expected)
        cache.view(layout.int_dtype).index_copy_(0, block_ids, body.to(cache.device, non_blocking=True))
