"""``tca-tbe``: the registry entry, frames assembled and taken apart around the bit-plane coder.

CPU tensors go through the numpy reference (``reference.py``); CUDA tensors through the Triton
kernels (``gpu.py``) when triton is importable, otherwise through the reference by way of host
copies. Either way the bytes are the reference's. A frame that would not be smaller than the
raw bytes is written as a stored frame (codec id 0), which ``decode`` reads too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..dtypes import layout_for
from ..errors import CodebookMismatch, CorruptFrame, OutputMismatch, UnsupportedTensor
from ..format import FrameCodec, stored_size
from ..frames import decode as decode_stored, checked_block_ids
from ..frames import encode_stored
from .. import prefix as frame_prefix
from ..registry import Capabilities, PositionFree
from ..staging import current_stream, optional_cupy, read_to_host
from . import reference
from .format import FRAME_ID, HEADER_SIZE, TcaTbeHeader, finish, make_header, padding_ranges, parse_header

DTYPES = (torch.bfloat16,)  # FP16's 10-bit mantissa leaves a 3-bit exponent code nothing to save
_WIRE_IDS = frozenset(layout_for(d).wire_id for d in DTYPES)


@dataclasses.dataclass(frozen=True)
class TcaTbeCodebook:
    """tca-tbe learns nothing ahead: each frame picks its own exponent window. The codebook
    exists so every codec's ``calibrate`` returns one, and it pins the dtype."""

    dtype: str = "bfloat16"

    def to_json(self) -> str:
        return json.dumps({"format": "kvferry-codebook", "version": 1, "codec": "tca-tbe", "dtype": self.dtype})

    @classmethod
    def from_json(cls, text: str | bytes) -> TcaTbeCodebook:
        """Raises: CodebookMismatch: not a tca-tbe codebook document."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise CodebookMismatch(f"malformed codebook JSON: {exc}") from None
        if (not isinstance(doc, dict) or doc.get("format") != "kvferry-codebook" or doc.get("codec") != "tca-tbe"
                or doc.get("dtype") not in {str(d).removeprefix("torch.") for d in DTYPES}):
            raise CodebookMismatch("not a tca-tbe codebook document")
        return cls(doc["dtype"])


def _check_tensor(x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise UnsupportedTensor(f"tca-tbe codes bfloat16, not {x.dtype}")
    if x.dim() > 8:
        raise UnsupportedTensor(f"rank {x.dim()} exceeds the format's maximum of 8")


def _check_book(x: torch.Tensor, codebook: Any) -> None:
    if codebook is None:
        return
    if not isinstance(codebook, TcaTbeCodebook):
        raise CodebookMismatch(f"tca-tbe needs a TcaTbeCodebook, got {type(codebook).__name__}")
    if codebook.dtype != str(x.dtype).removeprefix("torch."):
        raise CodebookMismatch(f"codebook is for {codebook.dtype}, the tensor is {x.dtype}")


def _use_gpu(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    from . import gpu

    return gpu.available()


def encode(x: torch.Tensor, codebook: TcaTbeCodebook | None = None, *, checksum: bool = True) -> torch.Tensor:
    """One frame of ``x`` on ``x.device``: a tca-tbe frame, or a stored frame (codec 0) if the
    tca-tbe frame would not be smaller. ``checksum`` adds a CRC32C of the streams (on the GPU
    path that costs a host copy of the frame).

    Raises:
        UnsupportedTensor: not a bfloat16 tensor of rank 8 or less.
        CodebookMismatch: a codebook that is not tca-tbe's.
    """
    _check_tensor(x)
    _check_book(x, codebook)
    if _use_gpu(x):
        from . import gpu

        with torch.cuda.device(x.device):  # triton launches on the current device
            return gpu.encode(x, checksum=checksum)
    return encode_reference(x.detach().cpu(), checksum=checksum).to(x.device)


def encode_reference(x: torch.Tensor, *, checksum: bool = True) -> torch.Tensor:
    """The frame as the reference writes it (CPU tensor in, CPU frame out)."""
    _check_tensor(x)
    bits = x.detach().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    window_low, in_window, streams = reference.encode_streams(bits)
    header = make_header(layout_for(x.dtype).wire_id, tuple(x.shape), window_low, in_window)
    if header.total >= stored_size(layout_for(x.dtype), header.numel):
        return encode_stored(x, checksum=checksum)
    return assemble(header, streams, checksum)


def assemble(header: TcaTbeHeader, streams: Sequence[bytes], checksum: bool) -> torch.Tensor:
    """Header and streams laid out in one frame, the stream CRC filled in if asked for."""
    buf = np.zeros(header.total, dtype=np.uint8)
    for offset, length, data in zip(header.offsets, header.lengths, streams):
        assert len(data) == length, (length, len(data))
        buf[offset:offset + length] = np.frombuffer(data, dtype=np.uint8)
    return finish(torch.from_numpy(buf), header, checksum)


def _prefix(frame: Any) -> bytes:
    """The frame's first bytes, up to a header's worth, in one device read; magic checked.

    Raises:
        CorruptFrame: not a 1-D uint8 tensor, no codec id, or the wrong magic.
    """
    frame_prefix.check_frame(frame)
    if frame.is_cuda and frame.is_contiguous() and optional_cupy() is not None:  # through pinned memory
        prefix = read_to_host(frame, min(frame.numel(), HEADER_SIZE), current_stream(frame.device)).tobytes()
    else:
        prefix = frame[:HEADER_SIZE].cpu().numpy().tobytes()
    frame_prefix.check_magic(prefix)
    return prefix


def _parse(prefix: bytes, frame: torch.Tensor) -> TcaTbeHeader:
    if prefix[frame_prefix.CODEC_ID_AT] != FRAME_ID:
        raise CorruptFrame("not a tca-tbe frame")
    return parse_header(prefix, frame.numel(), _WIRE_IDS)


def read_header(frame: torch.Tensor) -> TcaTbeHeader:
    """Validated header of a tca-tbe frame (reads the header and the frame's size only).

    Raises:
        CorruptFrame: not a tca-tbe frame, or a header that fails validation.
    """
    return _parse(_prefix(frame), frame)


def _check_stream_crc(frame: torch.Tensor, header: TcaTbeHeader) -> None:
    if header.stream_crc is not None and crc32c(memoryview(frame[HEADER_SIZE:].cpu().numpy())) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")


def _on_device(frame: Any, out: torch.Tensor) -> bool:
    """Whether ``frame`` and ``out`` suit the GPU path that checks the header on the device (no
    host read before the kernels start): both CUDA tensors of one device, contiguous."""
    return (isinstance(frame, torch.Tensor) and frame.is_cuda and out.is_cuda and frame.dtype == torch.uint8
            and frame.dim() == 1 and frame.is_contiguous() and out.is_contiguous()
            and out.get_device() == frame.get_device())  # ints: no torch.device objects per call


def decode(frame: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor a frame holds (tca-tbe or stored), on ``frame.device``, or written into ``out``
    (same dtype and element count, any shape). Everything is checked before ``out`` is touched.
    With ``out`` on the frame's GPU the header is checked there first (``gpu.decode_unparsed``);
    a frame that path declines is parsed on the host, as without ``out``.

    Raises:
        CorruptFrame: the frame is malformed, truncated, or fails a checksum.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    if (out is not None and isinstance(out, torch.Tensor) and out.dtype == DTYPES[0] and out.numel()
            and _on_device(frame, out) and _use_gpu(frame)):
        from . import gpu

        if gpu.decode_unparsed(frame, out):
            return out
    prefix = _prefix(frame)
    if prefix[frame_prefix.CODEC_ID_AT] == int(FrameCodec.STORED):
        return decode_stored(frame, out=out)
    if prefix[frame_prefix.CODEC_ID_AT] != FRAME_ID:
        raise CorruptFrame(f"codec id {prefix[frame_prefix.CODEC_ID_AT]} is not a tca-tbe (or stored) frame")
    header = _parse(prefix, frame)
    dtype = layout_for(DTYPES[0]).dtype
    if out is not None and (out.dtype != dtype or out.numel() != header.numel):
        raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds {dtype}[{header.numel}]")
    _check_stream_crc(frame, header)
    if _use_gpu(frame):
        from . import gpu

        direct = out is not None and out.is_cuda and out.device == frame.device and out.is_contiguous()
        target = out if direct else torch.empty(header.shape, dtype=dtype, device=frame.device)
        with torch.cuda.device(frame.device):
            gpu.decode_into(frame, header, target)  # validates everything before writing
        if out is None or direct:
            return target
        return out.copy_(target.view(out.shape))
    result = decode_reference(frame.cpu().numpy(), header).to(frame.device)
    return result if out is None else out.copy_(result.view(out.shape))


def decode_reference(buf: np.ndarray, header: TcaTbeHeader) -> torch.Tensor:
    """Reference decode of a frame (as numpy bytes) whose header passed ``parse_header`` (the
    stream CRC is the caller's).

    Raises:
        CorruptFrame: non-zero padding, or streams the bitmaps contradict.
    """
    for start, end in padding_ranges(header):
        if buf[start:end].any():
            raise CorruptFrame("padding between streams is not zero")
    streams = [buf[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    bits = reference.decode_streams(header, streams)
    if not header.numel:  # numpy's empty arrays come with stride 0, which later views reject
        return torch.empty(header.shape, dtype=DTYPES[0])
    return torch.from_numpy(bits.view(np.int16)).view(DTYPES[0]).view(header.shape)



def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  codebook: TcaTbeCodebook | None = None, *, checksum: bool = True) -> torch.Tensor:
    """Frame of ``cache[block_ids]`` (blocks along dim 0): the same bytes as ``encode`` of them.

    Raises:
        UnsupportedTensor, CodebookMismatch: as ``encode``.
        BlockOutOfRange: a block id outside the cache.
    """
    _check_tensor(cache)
    ids = checked_block_ids(block_ids, cache)
    blocks = cache.view(torch.int16).index_select(0, ids).view(cache.dtype)
    return encode(blocks, codebook, checksum=checksum)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
    """Write the frame's blocks into ``cache[block_ids]``; nothing is written if it is bad. On a
    GPU the kernels decode straight into the blocks where the cache allows, the header checked on
    the device first (``gpu.decode_blocks_unparsed``) or else on the host (``gpu.decode_blocks_into``).

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or ids repeat.
        BlockOutOfRange: a block id outside the cache.
    """
    if not isinstance(cache, torch.Tensor):
        raise OutputMismatch(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    ids = checked_block_ids(block_ids, cache, check=False)  # checked below: on the GPU by the kernels
    expected = (ids.numel(), *cache.shape[1:])
    if ids.numel() and cache.dim() and _on_device(frame, cache) and _use_gpu(frame):
        from . import gpu

        if gpu.decode_blocks_unparsed(frame, cache, ids, expected):
            return
    prefix = _prefix(frame)
    if prefix[frame_prefix.CODEC_ID_AT] == FRAME_ID:
        header = _parse(prefix, frame)
        if cache.dtype not in DTYPES or header.shape != expected:
            raise OutputMismatch(f"frame holds bfloat16{list(header.shape)}, blocks need "
                                 f"{str(cache.dtype).removeprefix('torch.')}{list(expected)}")
        if _use_gpu(frame) and cache.is_cuda:
            from . import gpu

            _check_stream_crc(frame, header)
            with torch.cuda.device(frame.device):
                if gpu.decode_blocks_into(frame, header, cache, ids):
                    return
    ids = checked_block_ids(ids, cache, unique=True)
    blocks = decode(frame)
    if blocks.dtype != cache.dtype or tuple(blocks.shape) != expected:
        raise OutputMismatch(f"frame holds {blocks.dtype}{list(blocks.shape)}, blocks need "
                             f"{cache.dtype}{list(expected)}")
    bits = layout_for(cache.dtype).int_dtype
    cache.view(bits).index_copy_(0, ids, blocks.to(cache.device).view(bits))


class TcaTbeCodec(PositionFree):
    """ZipServ's TCA-TBE for KV: per 64-element tile, three 64-bit bit-planes of a 3-bit exponent
    code (a window of 7 contiguous exponents per frame), a sign+mantissa byte for each element
    in the window and all 16 bits for the rest; fixed-length, so decode is branch-free and
    constant-time per element. BF16 only. Frames carry their window: decode needs no codebook.

    The registry entry (the engine's calls) writes frames without the stream CRC: the transport
    checks every payload already (CRC32C on the host, the segmented CRC32C on the GPU), and a
    host CRC of a GPU frame costs a device-to-host copy of it (H200: 1 GiB in ~0.6 s instead of
    ~0.8 ms). The module-level ``encode`` still adds one by default."""

    name = "tca-tbe"
    frame_id = FRAME_ID
    capabilities = Capabilities(lossless=True, standalone=True)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPES

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Raises: UnsupportedTensor: a dtype other than bfloat16."""
        if dtype not in DTYPES:
            raise UnsupportedTensor(f"tca-tbe codes bfloat16, not {dtype}")
        # A tca-tbe frame is written only if it is smaller than the stored one.
        return stored_size(layout_for(dtype), int(np.prod(tuple(shape), dtype=np.int64)))

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None) -> TcaTbeCodebook:
        first = samples if isinstance(samples, torch.Tensor) else next(iter(samples), None)
        if first is not None:
            _check_tensor(first)
        return TcaTbeCodebook()

    def codebook_from_json(self, text: str | bytes) -> TcaTbeCodebook:
        return TcaTbeCodebook.from_json(text)

    def encode(self, x: torch.Tensor, codebook: TcaTbeCodebook | None = None) -> torch.Tensor:
        return encode(x, codebook, checksum=False)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(frame, out=out)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: TcaTbeCodebook | None = None) -> torch.Tensor:
        return encode_blocks(cache, block_ids, codebook, checksum=False)  # see the class docstring

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        decode_blocks(frame, cache, block_ids)
