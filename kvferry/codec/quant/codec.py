"""``k8v4`` and ``k4v2``: the registry entries, frames assembled and taken apart.

CPU tensors go through the torch reference (``reference.py``); CUDA tensors through the Triton
kernels (``gpu.py``) when triton imports, otherwise through the reference by way of host copies.
Either way the bytes are the reference's. The stream CRC is computed on a host copy of the frame.
On the GPU a call synchronizes with the host little: reading a frame's header, and once at the
end to raise what the kernels flagged (bad values, bad or repeated block ids, a corrupt frame);
block ids already on the device are checked there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..checksum import crc32c
from ..errors import BlockOutOfRange, CodebookMismatch, CorruptFrame, OutputMismatch, UnsupportedTensor
from ..layout import BlockLayout
from ..registry import Capabilities, CodecBase
from . import reference
from .format import (BITS, DTYPE_IDS, HEADER_SIZE, QuantHeader, Stream, check_geometry, frame_size,
                     parse_header)

LAYOUT_FORMAT = "kvferry.quant.layout"
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class QuantLayout:
    """Which axis separates K from V (index 0 = K) and which holds a vector's channels.

    For ``encode``/``decode`` the axes are the tensor's; for ``encode_blocks``/``decode_blocks``
    (what ``bind`` returns) they are a block's, the cache's dim 0 being the block axis.
    """

    kv_axis: int
    channel_axis: int

    def __post_init__(self) -> None:
        if not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < 8
                   for a in (self.kv_axis, self.channel_axis)) or self.kv_axis == self.channel_axis:
            raise CodebookMismatch(f"kv axis {self.kv_axis!r} and channel axis {self.channel_axis!r} must be "
                                   "two different axes in 0..7")

    @classmethod
    def of(cls, axes: Sequence[str], codec: str = "quant") -> QuantLayout:
        """The layout of tensors whose dimensions are named ``axes`` (``kv`` and ``channel`` needed).

        Raises:
            CodebookMismatch: ``kv`` or ``channel`` is not among the names.
        """
        missing = [n for n in ("kv", "channel") if n not in axes]
        if missing:
            raise CodebookMismatch(f"{codec} needs the {' and '.join(missing)} axis named (axes: {list(axes)})")
        return cls(list(axes).index("kv"), list(axes).index("channel"))

    def shifted(self, by: int) -> QuantLayout:
        return QuantLayout(self.kv_axis + by, self.channel_axis + by)

    def to_json(self) -> str:
        return json.dumps({"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "kv_axis": self.kv_axis,
                           "channel_axis": self.channel_axis}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> QuantLayout:
        """Raises: CodebookMismatch: not a quant layout document of this version."""
        try:
            doc = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise CodebookMismatch(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT:
            raise CodebookMismatch(f"not a {LAYOUT_FORMAT} document")
        if doc.get("version") != LAYOUT_VERSION:
            raise CodebookMismatch(f"{LAYOUT_FORMAT} version {doc.get('version')!r}; this build reads {LAYOUT_VERSION}")
        if set(doc) != {"format", "version", "kv_axis", "channel_axis"}:
            raise CodebookMismatch(f"unexpected fields {sorted(set(doc) - {'format', 'version'})}")
        return cls(doc["kv_axis"], doc["channel_axis"])


def quant_layout(axes: Sequence[str]) -> QuantLayout:
    """``QuantLayout.of(axes)``: the layout of tensors with dimensions named ``axes``."""
    return QuantLayout.of(axes)


def _gpu() -> ModuleType | None:
    try:
        from . import gpu
    except ImportError:
        return None
    return gpu


def _check_tensor(x: Any, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_IDS:
        raise UnsupportedTensor(f"{name} codes bfloat16 or float16, not {x.dtype}")


def _layout(codebook: Any, name: str) -> QuantLayout:
    if not isinstance(codebook, QuantLayout):
        raise CodebookMismatch(f"{name} needs a QuantLayout naming the kv and channel axes (quant_layout(axes), "
                               f"calibrate(..., axes=...) or bind), got {type(codebook).__name__}")
    return codebook


def _ids(block_ids: Sequence[int] | torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Block ids as int64 on the cache's device, and whether they are still to be checked: ids
    already on a CUDA cache's device are left to the kernels (no host synchronization);
    ``_check_ids`` checks the others here."""
    ids = torch.as_tensor(block_ids).reshape(-1)
    if ids.is_cuda and ids.device == cache.device and _gpu() is not None:
        return ids.to(torch.int64), True
    return ids.to(torch.int64), False


def _check_ids(ids: torch.Tensor, cache: torch.Tensor, unique: bool = False) -> torch.Tensor:
    """``ids`` checked (on the host) and moved to the cache's device.

    Raises:
        BlockOutOfRange: an id outside the cache; OutputMismatch: ids repeat (when ``unique``).
    """
    host = ids.cpu()
    if host.numel():
        if int(host.min()) < 0 or int(host.max()) >= cache.shape[0]:
            raise BlockOutOfRange(f"block ids must be in 0..{cache.shape[0] - 1}")
        if unique and torch.unique(host).numel() != host.numel():
            raise OutputMismatch("block ids repeat")
    return ids.to(cache.device)


def _finish(frame: torch.Tensor, header: QuantHeader, checksum: bool) -> torch.Tensor:
    """Zero the padding, then write the header (with the CRC of everything after it if asked)."""
    for (o, n), nxt in zip(zip(header.offsets, header.lengths), header.offsets[1:]):
        frame[o + n:nxt].zero_()
    if checksum:
        header = header.with_crc(crc32c(memoryview(frame[HEADER_SIZE:].cpu().numpy())))
    frame[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    return frame


def _encode(src: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None, checksum: bool,
            unchecked: bool = False) -> torch.Tensor:
    gpu = _gpu() if src.is_cuda else None
    if gpu is not None:
        frame = torch.empty(header.total, dtype=torch.uint8, device=src.device)
        if not checksum:  # header and padding first, while the device is idle: one sync, at the end
            _finish(frame, header, False)
        gpu.encode_into(src, frame, header, ids, check_ids=unchecked)
        return _finish(frame, header, True) if checksum else frame
    if unchecked:
        ids = _check_ids(ids, src)
    x = src if ids is None else src.index_select(0, ids)
    streams = reference.encode_streams(x.detach().cpu(), header.kv_axis, header.channel_axis, header.bits)
    buf = bytearray(header.total)
    for offset, data in zip(header.offsets, streams):
        buf[offset:offset + len(data)] = data
    frame = torch.frombuffer(buf, dtype=torch.uint8)
    return _finish(frame, header, checksum).to(src.device)


def encode(x: torch.Tensor, codebook: QuantLayout, frame_id: int, *, checksum: bool = True) -> torch.Tensor:
    """The frame (1-D uint8 on ``x.device``) of ``x`` coded by codec ``frame_id`` (3 = k8v4, 4 = k4v2).

    Raises:
        UnsupportedTensor: a dtype other than bfloat16/float16, a non-finite or out-of-range
            element, or a channel count whose codes do not fill whole bytes.
        CodebookMismatch: ``codebook`` is not a QuantLayout that fits ``x``.
    """
    name = _NAMES[frame_id]
    _check_tensor(x, name)
    layout = _layout(codebook, name)
    check_geometry(tuple(x.shape), layout.kv_axis, layout.channel_axis, BITS[frame_id])
    header = QuantHeader(frame_id, x.dtype, tuple(x.shape), layout.kv_axis, layout.channel_axis)
    return _encode(x, header, None, checksum)


def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codebook: QuantLayout,
                  frame_id: int, *, checksum: bool = True) -> torch.Tensor:
    """Frame of ``cache[block_ids]`` (``codebook``'s axes are a block's): the bytes ``encode`` of
    those blocks writes with the axes shifted by one; CUDA caches are gathered by the kernels.

    Raises:
        as ``encode``; BlockOutOfRange: a block id outside the cache.
    """
    name = _NAMES[frame_id]
    _check_tensor(cache, name)
    layout = _layout(codebook, name).shifted(1)
    ids, unchecked = _ids(block_ids, cache)
    if not unchecked:
        ids = _check_ids(ids, cache)
    shape = (ids.numel(), *cache.shape[1:])
    check_geometry(shape, layout.kv_axis, layout.channel_axis, BITS[frame_id])
    header = QuantHeader(frame_id, cache.dtype, shape, layout.kv_axis, layout.channel_axis)
    return _encode(cache, header, ids, checksum, unchecked)


def read_header(frame: torch.Tensor) -> QuantHeader:
    """Validated header of a quant frame.

    Raises:
        CorruptFrame: not a quant frame, or a header that fails validation.
    """
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise CorruptFrame("a frame is a 1-D torch.uint8 tensor")
    return parse_header(frame[:HEADER_SIZE].cpu().numpy().tobytes(), frame.numel())


def _checked(frame: torch.Tensor, header: QuantHeader | None = None) -> QuantHeader:
    """The header of a frame whose every byte has been checked: CRC, padding, scales and zeros."""
    header = header if header is not None else read_header(frame)
    _check_crc(frame, header)
    for (o, n), nxt in zip(zip(header.offsets, header.lengths), header.offsets[1:]):
        if frame[o + n:nxt].any():
            raise CorruptFrame("padding between streams is not zero")
    p = frame[header.offsets[Stream.PARAMS]:header.total].view(-1, 2, 2)
    bits = (p[:, :, 0].to(torch.int32) | (p[:, :, 1].to(torch.int32) << 8))
    scale, zero = bits[:, 0], bits[:, 1]
    # Scales are positive finite fp16 (>= 2**-24), zeros finite fp16: anything else is not ours.
    if ((scale & 0x7C00) == 0x7C00).any() or (scale & 0x8000).any() or (scale == 0).any() \
            or ((zero & 0x7C00) == 0x7C00).any():
        raise CorruptFrame(BAD_PARAMS_TEXT)
    return header


BAD_PARAMS_TEXT = "a scale or zero point is not a finite fp16 (scales positive)"


def _check_crc(frame: torch.Tensor, header: QuantHeader) -> None:
    if header.stream_crc is not None and crc32c(memoryview(frame[HEADER_SIZE:].cpu().numpy())) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")


def _reconstruct(frame: torch.Tensor, header: QuantHeader, dst: torch.Tensor | None,
                 ids: torch.Tensor | None, unchecked: bool = False) -> torch.Tensor | None:
    """Check a frame (its header already valid) and write its values into ``dst`` (``dst[ids]``;
    ``unchecked``: ids still to be checked) or return them as a new tensor. Nothing is written
    when anything is wrong. On the GPU one kernel checks the frame (and ids) and the decode
    kernels write only if it found nothing: one host synchronization, at the end."""
    target = dst if dst is not None else torch.empty(header.shape, dtype=header.dtype, device=frame.device)
    gpu = _gpu() if frame.is_cuda and target.is_cuda else None
    if gpu is not None and gpu.supports_in_place(target, header.kv_axis, header.channel_axis, ids is not None):
        _check_crc(frame, header)
        if frame.storage_offset() % 16:
            frame = frame.clone()
        flag = gpu.check_frame(frame, header, ids if unchecked else None, target.shape[0])
        gpu.decode_into(frame, target, header, ids, flag=flag)
        code = int(flag.item())
        if code & gpu.BAD_ID:
            raise BlockOutOfRange(f"block ids must be in 0..{target.shape[0] - 1}")
        if code & gpu.REPEATED_ID:
            raise OutputMismatch("block ids repeat")
        if code & gpu.BAD_PADDING:
            raise CorruptFrame("padding between streams is not zero")
        if code:
            raise CorruptFrame(BAD_PARAMS_TEXT)
        return target
    if unchecked:
        ids = _check_ids(ids, target, unique=True)
    _checked(frame, header)
    host = frame.cpu()
    streams = [host[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    values = reference.decode_streams(*streams, header.shape, header.kv_axis, header.channel_axis, header.bits,
                                      header.dtype).to(target.device)
    if ids is not None:
        target.index_copy_(0, ids, values)
    elif dst is not None:
        target.copy_(values.view(target.shape))
    else:
        target = values
    return target


def decode(frame: torch.Tensor, *, out: torch.Tensor | None = None, header: QuantHeader | None = None) -> torch.Tensor:
    """The reconstructed tensor on ``frame.device``, or written into ``out`` (same dtype and
    element count, any shape). Everything is checked before ``out`` is touched. ``header``: the
    frame's, from ``read_header`` (saves reading it again).

    Raises:
        CorruptFrame: the frame is malformed, truncated, or fails a checksum.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    header = header if header is not None else read_header(frame)
    if out is not None:
        if out.dtype != header.dtype or out.numel() != header.numel:
            raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds {header.dtype}[{header.numel}]")
        if tuple(out.shape) != header.shape or not out.is_contiguous():
            out.copy_(_reconstruct(frame, header, None, None).view(out.shape))
            return out
    return _reconstruct(frame, header, out, None)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  codebook: QuantLayout | None = None, *, header: QuantHeader | None = None) -> None:
    """Write the frame's blocks into ``cache[block_ids]``; nothing is written if it is bad.
    ``header``: the frame's, from ``read_header`` (saves reading it again).

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or ids repeat.
        CodebookMismatch: the frame's axes are not ``codebook``'s (when given).
        BlockOutOfRange: a block id outside the cache.
    """
    if not isinstance(cache, torch.Tensor) or cache.dtype not in DTYPE_IDS:
        raise OutputMismatch("the cache must be a bfloat16 or float16 tensor")
    ids, unchecked = _ids(block_ids, cache)
    if not unchecked:
        ids = _check_ids(ids, cache, unique=True)
    header = header if header is not None else read_header(frame)
    expected = (ids.numel(), *cache.shape[1:])
    if header.dtype != cache.dtype or header.shape != expected:
        raise OutputMismatch(f"frame holds {header.dtype}{list(header.shape)}, blocks need "
                             f"{cache.dtype}{list(expected)}")
    if codebook is not None and _layout(codebook, _NAMES[header.frame_id]).shifted(1) != \
            QuantLayout(header.kv_axis, header.channel_axis):
        raise CodebookMismatch(f"frame codes kv axis {header.kv_axis - 1} and channel axis "
                               f"{header.channel_axis - 1} of a block; bound layout is {codebook}")
    _reconstruct(frame, header, cache, ids, unchecked)


class QuantCodec(CodecBase):
    """DiffKV's asymmetric per-vector quantization: K at ``k_bits``, V at ``v_bits``, an fp16
    scale and zero point per vector. Lossy, so never ``auto``'s pick; frames are self-describing.

    The registry entry (the engine's calls) writes frames without the stream CRC: the transport
    checks every payload already (CRC32C on the host, the segmented CRC32C on the GPU), and a
    host CRC of a GPU frame costs a device-to-host copy of it (H200: 1 GiB in ~0.6 s instead of
    ~0.8 ms). The module-level ``encode`` still adds one by default."""

    capabilities = Capabilities()  # lossy; frames are self-describing

    def __init__(self, name: str, frame_id: int) -> None:
        self.name, self.frame_id = name, frame_id
        self.k_bits, self.v_bits = BITS[frame_id]

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPE_IDS

    def capacity(self, shape: Sequence[int], dtype: torch.dtype, layout: QuantLayout | None = None) -> int:
        """Exact frame bytes with ``layout``; without one, the largest over every axis pair that
        could be (kv, channel).

        Raises:
            UnsupportedTensor: an unsupported dtype, or no axis pair that can be coded.
        """
        if dtype not in DTYPE_IDS:
            raise UnsupportedTensor(f"{self.name} codes bfloat16 or float16, not {dtype}")
        shape = tuple(int(d) for d in shape)
        pairs = [(layout.kv_axis, layout.channel_axis)] if layout is not None else \
            [(a, c) for a in range(len(shape)) for c in range(len(shape)) if a != c]
        sizes = []
        for a, c in pairs:
            try:
                check_geometry(shape, a, c, BITS[self.frame_id])
            except (CodebookMismatch, UnsupportedTensor):
                if layout is not None:
                    raise
                continue
            sizes.append(frame_size(shape, a, c, self.frame_id))
        if not sizes:
            raise UnsupportedTensor(f"{self.name}: no axis of {list(shape)} has 2 entries (K, V) beside a "
                                    "channel axis it can code")
        return max(sizes)

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None) -> QuantLayout:
        """The layout named by ``axes`` (the samples' dimension names); nothing is learnt.

        Raises:
            CodebookMismatch: ``axes`` is missing, does not name kv and channel, or does not fit.
        """
        if axes is None:
            raise CodebookMismatch(f"{self.name} learns nothing from samples but needs their axes named: "
                                   "calibrate(samples, axes=(..., 'kv', ..., 'channel'))")
        layout = QuantLayout.of(axes, self.name)
        first = samples if isinstance(samples, torch.Tensor) else next(iter(samples), None)
        if isinstance(first, torch.Tensor) and first.dim() != len(axes):
            raise CodebookMismatch(f"{len(axes)} axis names for samples of {first.dim()} dimensions")
        return layout

    def codebook_from_json(self, text: str | bytes) -> QuantLayout:
        return QuantLayout.from_json(text)

    def bind(self, codebook: Any, layout: BlockLayout | None, reference: torch.Tensor | None = None) -> QuantLayout:
        """The block layout's kv and channel axes, as ``encode_blocks``/``decode_blocks`` take them.

        Raises:
            CodebookMismatch: no block layout, one without kv or channel axes, or a reference.
        """
        if reference is not None:
            raise CodebookMismatch(f"{self.name} codes without a reference region")
        if codebook is not None and not isinstance(codebook, QuantLayout):
            raise CodebookMismatch(f"{self.name} takes no codebook but its layout, got {type(codebook).__name__}")
        if layout is None:
            raise CodebookMismatch(f"{self.name} needs the region's axes named (kv and channel at least)")
        kv, channel = layout.require("kv", "channel", codec=self.name)
        try:
            check_geometry((1, *layout.shape), kv + 1, channel + 1, BITS[self.frame_id])
        except UnsupportedTensor as exc:
            raise CodebookMismatch(f"{self.name} cannot code these blocks: {exc}") from None
        return QuantLayout(kv, channel)

    def encode(self, x: torch.Tensor, codebook: QuantLayout | None = None) -> torch.Tensor:
        return encode(x, codebook, self.frame_id, checksum=False)

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        header = read_header(frame)
        if header.frame_id != self.frame_id:
            raise CorruptFrame(f"a {_NAMES[header.frame_id]} frame given to {self.name}")
        return decode(frame, out=out, header=header)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: QuantLayout | None = None) -> torch.Tensor:
        return encode_blocks(cache, block_ids, codebook, self.frame_id, checksum=False)  # see the class docstring

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: QuantLayout | None = None) -> None:
        header = read_header(frame)
        if header.frame_id != self.frame_id:
            raise CorruptFrame(f"not a {self.name} frame")
        decode_blocks(frame, cache, block_ids, codebook, header=header)


_NAMES = {3: "k8v4", 4: "k4v2"}
K8V4 = QuantCodec("k8v4", 3)
K4V2 = QuantCodec("k4v2", 4)
