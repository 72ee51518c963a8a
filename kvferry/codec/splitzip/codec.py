"""``splitzip``: the registry entry over SplitZip's frames (``kvferry/codec/frames.py``, FORMAT.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..codebook import Codebook, calibrate
from ..dtypes import supported
from ..format import FrameCodec
from .. import frames  # whole frames; it imports this package's kernels, so by module
from ..layout import BlockLayout
from ..registry import Capabilities, PositionFree
from ..staging import Pending


class SplitZipCodec(PositionFree):
    """Lossless exponent coding (top-16 exponents, escapes); stores a frame that would not shrink."""

    name = "splitzip"
    frame_id = int(FrameCodec.SPLITZIP)
    capabilities = Capabilities(lossless=True, standalone=True, learns=True, starts_blocks=True)

    def supports(self, dtype: torch.dtype) -> bool:
        return supported(dtype)

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return frames.frame_capacity(tuple(shape), dtype)

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None) -> Codebook:
        # One global exponent table: the token axis does not change it.
        return calibrate(samples)

    def learn(self, sample: torch.Tensor, layout: BlockLayout | None = None) -> Codebook:
        """What ``encode`` without a codebook would calibrate on ``sample`` (one global table:
        the block layout does not change it)."""
        return calibrate(sample)

    def codebook_from_json(self, text: str | bytes) -> Codebook:
        return Codebook.from_json(text)

    def encode(self, x: torch.Tensor, codebook: Codebook | None = None) -> torch.Tensor:
        return frames.encode(x, codebook)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return frames.decode(frame, out=out)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, codebook: Codebook | None = None) -> torch.Tensor:
        return frames.encode_blocks(cache, block_ids, codebook)

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        frames.decode_blocks(frame, cache, block_ids)

    def start_encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Codebook | None = None) -> Pending[torch.Tensor]:
        return frames.start_encode_blocks(cache, block_ids, codebook)

    def start_decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[None]:
        return frames.start_decode_blocks(frame, cache, block_ids)
