"""Codecs as plug-ins: the ``Codec`` protocol and the registry of name → codec.

Adding a codec is one subpackage that implements ``Codec`` and one ``register`` line in
``kvferry/codec/__init__.py``; the engine names no codec, it asks the registry and reads each
codec's declared ``Capabilities``. Every codec's frame starts with the same 7 bytes (magic,
version, codec id: ``prefix.py``, FORMAT.md), so any frame says which codec made it and
``codec_of`` can dispatch on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from . import prefix
from .errors import CodebookMismatch, CodecError, CorruptFrame, InvalidArgument
from .layout import BlockLayout
from .staging import Pending


class UnknownCodec(CodecError, KeyError):
    """No codec is registered under that name or frame id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@runtime_checkable
class Codebook(Protocol):
    """What a codec learns from sample data, serialisable as a versioned JSON document."""

    def to_json(self) -> str: ...


@dataclass(frozen=True)
class Capabilities:
    """What a codec can do, declared once on the codec: the engine reads these and probes nothing.

    ``lossless``: decode reproduces every bit. ``standalone``: it needs nothing but the data and a
    codebook it can calibrate from it; a lossless standalone codec is an ``auto`` candidate.
    ``identity``: its frames hold the blocks as they are (``raw``), so a same-host write may stand
    in for its frames. ``learns``: given no codebook, it learns one from the data, and ``learn``
    says which, so a caller coding many chunks of a region learns once. ``decode_needs_codebook``:
    the receiver must hold the sender's codebook. ``starts_blocks``: ``start_encode_blocks`` /
    ``start_decode_blocks`` launch GPU work without the host waiting in between, so a caller on an
    event loop can await the GPU instead of blocking on it.
    """

    lossless: bool = False
    standalone: bool = False
    identity: bool = False
    learns: bool = False
    decode_needs_codebook: bool = False
    starts_blocks: bool = False


@runtime_checkable
class Codec(Protocol):
    """A KV codec: pure functions over tensors, GPU path and CPU reference writing the same bytes.

    ``frame_id`` is the codec byte of its frames; ``capabilities`` says what else the caller may
    rely on (``Capabilities``). ``CodecBase`` supplies the members a codec without a capability
    needs no code for.
    """

    name: str
    frame_id: int
    capabilities: Capabilities

    @property
    def lossless(self) -> bool:
        """``capabilities.lossless``."""

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether tensors of ``dtype`` can be encoded."""

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Worst-case frame bytes for a tensor of this shape and dtype (receive buffers)."""

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None) -> Any:
        """A codebook fitted to ``samples``; ``axes`` names their dimensions (``layout.py``) for
        codecs that model KV by position. Codec-specific options are further keywords."""

    def learn(self, sample: torch.Tensor, layout: BlockLayout | None = None) -> Any:
        """The codebook ``encode_blocks`` without one would learn from ``sample`` (``[blocks,
        *block]``; ``layout``: the block's named axes, or None). Only if ``capabilities.learns``."""

    def codebook_from_json(self, text: str | bytes) -> Any:
        """Parse a codebook document; raises ``CodebookMismatch`` if it is not one of ours."""

    def bind(self, codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None = None) -> Any:
        """What ``encode_blocks``/``decode_blocks`` of this region's blocks take as their codebook.

        Called once per transfer and region, before anything is sent: a codec that models KV by
        position checks the codebook against the block layout here (``reference`` is the region
        holding a predictor's KV for codecs that code against one). Raises ``CodebookMismatch``.
        """

    def encode(self, x: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        """One self-describing frame (1-D uint8 on ``x.device``)."""

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor a frame holds (into ``out`` if given); ``CorruptFrame`` on bad input."""

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, codebook: Any = None) -> torch.Tensor:
        """Frame of ``cache[block_ids]`` (blocks along dim 0), read in place where possible."""

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        """Write the frame's blocks into ``cache[block_ids]``; nothing is written if it is bad."""

    def start_encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[torch.Tensor]:
        """``encode_blocks`` launched on the current stream: a ``Pending`` of its frame. Runs
        without the host waiting only if ``capabilities.starts_blocks``."""

    def start_decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[None]:
        """``decode_blocks`` launched on the current stream, likewise."""


class CodecBase:
    """The members of ``Codec`` that follow from ``capabilities``, for codecs to inherit: a codec
    declares its ``capabilities`` and overrides what they promise (``learn`` where it ``learns``,
    the ``start_*`` methods where it ``starts_blocks``)."""

    name: str
    capabilities: Capabilities = Capabilities()

    @property
    def lossless(self) -> bool:
        return self.capabilities.lossless

    def learn(self, sample: torch.Tensor, layout: BlockLayout | None = None) -> Any:
        raise CodecError(f"codec {self.name!r} learns no codebook from the data")

    def start_encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[torch.Tensor]:
        return Pending.done(self.encode_blocks(cache, block_ids, codebook))  # type: ignore[attr-defined]

    def start_decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[None]:
        self.decode_blocks(frame, cache, block_ids, codebook)  # type: ignore[attr-defined]
        return Pending.done(None)


class PositionFree(CodecBase):
    """Base for codecs that code every element alike: any block layout will do, no reference."""

    def bind(self, codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None = None) -> Any:
        if reference is not None:
            raise CodebookMismatch(f"{getattr(self, 'name', 'this codec')} codes without a reference region")
        return codebook


_BY_NAME: dict[str, Codec] = {}
_BY_FRAME_ID: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add ``codec`` to the registry (import time only: the registry is a constant afterwards).

    Raises:
        InvalidArgument: its name or frame id is taken.
    """
    if codec.name in _BY_NAME or codec.name == "auto":
        raise InvalidArgument(f"codec name {codec.name!r} is taken")
    if codec.frame_id in _BY_FRAME_ID:
        raise InvalidArgument(f"frame id {codec.frame_id} is taken by {_BY_FRAME_ID[codec.frame_id].name!r}")
    _BY_NAME[codec.name] = codec
    _BY_FRAME_ID[codec.frame_id] = codec
    return codec


def names() -> list[str]:
    """Registered codec names, in registration order."""
    return list(_BY_NAME)


def get(name: str) -> Codec:
    """The codec registered as ``name``.

    Raises:
        UnknownCodec: nothing is registered under that name.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownCodec(f"no codec named {name!r} (registered: {', '.join(_BY_NAME)})") from None


def codec_of(frame: torch.Tensor) -> Codec:
    """The codec that wrote ``frame``, from its codec byte (the header is checked by its decoder).

    Raises:
        CorruptFrame: too short, wrong magic, or a codec id nobody registered.
    """
    codec = _BY_FRAME_ID.get(codec_id(frame))
    if codec is None:
        raise CorruptFrame(f"unknown codec id {codec_id(frame)}")
    return codec


def codec_id(frame: torch.Tensor) -> int:
    """The codec byte of ``frame`` after checking its shape and magic.

    Raises:
        CorruptFrame: not a 1-D uint8 tensor, too short, or wrong magic.
    """
    prefix.check_frame(frame)
    return prefix.codec_id(frame[:prefix.SIZE].cpu().numpy().tobytes())


def lossless() -> list[Codec]:
    """Registered lossless codecs that need nothing beyond the data: ``auto``'s candidates."""
    return [c for c in _BY_NAME.values() if c.capabilities.lossless and c.capabilities.standalone]
