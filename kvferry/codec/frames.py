"""``encode`` and ``decode``: whole self-describing frames, on the tensor's own device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from . import bitpack
from .splitzip import gpu as splitzip_gpu, reference as splitzip
from .checksum import crc32c
from .codebook import Codebook, calibrate
from .dtypes import LAYOUTS, FloatLayout, layout_for
from .errors import (BlockOutOfRange, CodebookMismatch, CorruptFrame, InvalidArgument, OutputMismatch,
                     UnsupportedTensor)
from .fields import as_bits, split
from .format import (DEFAULT_CHUNK, HEADER_SIZE, MAX_CHUNK, MAX_NDIM, FrameCodec, Header, Stream,
                     make_header, parse_header, splitzip_size, stored_size)
from .staging import Pending, current_stream, read_to_host


def encode(x: torch.Tensor, codebook: Codebook | None = None, *, checksum: bool = False,
           chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Encode ``x`` into one frame: a 1-D uint8 tensor on ``x.device``.

    ``codebook=None`` calibrates on ``x`` itself. The frame is SplitZip-coded when that is smaller
    than storing the raw bytes, else stored; either way it never exceeds header + raw size.
    ``checksum=True`` adds a CRC32C of the streams, verified by ``decode``. CUDA tensors go
    through the GPU kernels when CuPy is present; the bytes are the same either way.

    Raises:
        UnsupportedTensor: dtype other than bf16/fp16/fp8 e5m2/fp8 e4m3fn, or rank above 8.
        CodebookMismatch: the codebook is for another dtype.
    """
    layout = _check_tensor(x)
    book = _codebook_for(x, codebook, layout, chunk)
    if _on_gpu(x, chunk) and x.numel():
        return splitzip_gpu.encode(x.contiguous(), None, 0, tuple(x.shape), layout,
                                   book.exponents, chunk, checksum)
    return _encode(x, book, checksum=checksum, chunk=chunk, force=None)


def encode_stored(x: torch.Tensor, *, checksum: bool = False) -> torch.Tensor:
    """A stored frame of ``x`` (codec id 0: header, then the raw bytes), on ``x.device``."""
    _check_tensor(x)
    return _encode(x, None, checksum=checksum, chunk=DEFAULT_CHUNK, force=FrameCodec.STORED)


def frame_capacity(shape: Sequence[int], dtype: torch.dtype, *, chunk: int = DEFAULT_CHUNK) -> int:
    """Bytes an ``encode_into``/``encode_blocks_into`` buffer needs for a tensor of this shape."""
    return splitzip_gpu.capacity(layout_for(dtype), tuple(shape), chunk)


def encode_into(x: torch.Tensor, codebook: Codebook, out: torch.Tensor, *, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Encode ``x`` into the 1-D uint8 buffer ``out`` (``frame_capacity`` bytes at least), the
    frame being ``out[:length]``; returns ``length`` as a 0-d int64 tensor on ``out.device``.

    On the GPU nothing waits for the device: the frame's size, which depends on the data, stays
    on the device until the caller reads it, so encodes can be queued back to back on a stream.
    Same bytes as ``encode(x, codebook)``.

    Raises:
        UnsupportedTensor, CodebookMismatch: as ``encode``.
        OutputMismatch: ``out`` is too small, not 1-D uint8, or on another device.
    """
    layout = _check_tensor(x)
    book = _codebook_for(x, codebook, layout, chunk)
    return _encode_into(x.contiguous() if x.is_cuda else x, tuple(x.shape), layout, book, chunk, out)


def encode_blocks_into(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codebook: Codebook,
                       out: torch.Tensor, *, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """``encode_into`` for ``cache[block_ids]``, reading the blocks in place on the GPU.

    On the GPU the block ids are checked there too, so that nothing waits: a length of -1 means
    an id lies outside the cache (no block was read, nothing written). Elsewhere that raises
    BlockOutOfRange, as ``encode_blocks`` does.
    """
    layout = _check_tensor(cache)
    book = _codebook_for(cache, codebook, layout, chunk)
    if _blocks_on_gpu(cache, chunk):
        ids = checked_block_ids(block_ids, cache, check=False)
        if ids.numel():
            shape = (ids.numel(), *cache.shape[1:])
            _check_buffer(out, cache.device, frame_capacity(shape, cache.dtype, chunk=chunk))
            return splitzip_gpu.encode_into(cache, ids, _block_elems(cache), shape, layout, book.exponents, chunk, out)
    ids = checked_block_ids(block_ids, cache)
    return _encode_into(_gather(cache, ids), (ids.numel(), *cache.shape[1:]), layout, book, chunk, out)


def _encode_into(x: torch.Tensor, shape: tuple[int, ...], layout: FloatLayout, book: Codebook, chunk: int,
                 out: torch.Tensor) -> torch.Tensor:
    _check_buffer(out, x.device, frame_capacity(shape, layout.dtype, chunk=chunk))
    if _on_gpu(x, chunk) and x.numel():
        return splitzip_gpu.encode_into(x, None, 0, shape, layout, book.exponents, chunk, out)
    frame = encode(x.view(shape), book, chunk=chunk)
    out[: frame.numel()].copy_(frame)
    return torch.tensor(frame.numel(), dtype=torch.int64, device=out.device)


def _check_buffer(out: torch.Tensor, device: torch.device, needed: int) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise OutputMismatch("out must be a contiguous 1-D torch.uint8 tensor")
    if out.device != device:
        raise OutputMismatch(f"out is on {out.device}, the tensor on {device}")
    if out.numel() < needed:
        raise OutputMismatch(f"out holds {out.numel()} bytes, the frame may need {needed} (frame_capacity)")


def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codebook: Codebook | None = None,
                  *, checksum: bool = False, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Frame of the blocks ``cache[block_ids]`` (blocks along dim 0), byte-identical to
    ``encode(cache[block_ids], codebook)``. On the GPU the kernels read the blocks in place.

    Raises:
        UnsupportedTensor, CodebookMismatch: as ``encode``.
        BlockOutOfRange: a block id outside the cache.
    """
    layout = _check_tensor(cache)
    # The GPU kernels check the ids themselves (no wait here); calibrating reads the blocks first.
    on_gpu = _blocks_on_gpu(cache, chunk) and codebook is not None
    ids = checked_block_ids(block_ids, cache, check=not on_gpu)
    if codebook is None:
        codebook = calibrate(_gather(cache, ids))  # needs the data; pass a codebook to avoid it
    book = _codebook_for(cache, codebook, layout, chunk)
    if on_gpu:
        shape = (ids.numel(), *cache.shape[1:])
        return splitzip_gpu.encode(cache, ids, _block_elems(cache), shape, layout, book.exponents, chunk, checksum)
    return encode(_gather(cache, ids), book, checksum=checksum, chunk=chunk)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
    """Decode a frame of ``len(block_ids)`` blocks into those slots of ``cache``; no other block
    is touched, and none at all if the frame is bad.

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or block ids repeat.
        BlockOutOfRange: a block id outside the cache.
    """
    if _unparsed_on_gpu(frame, cache) and _blocks_on_gpu(cache, 8) and cache.dim() <= MAX_NDIM:
        ids = checked_block_ids(block_ids, cache, check=False)  # checked on the device
        shape = (ids.numel(), *cache.shape[1:])
        if ids.numel() and splitzip_gpu.decode_unparsed(
                splitzip_gpu.check_alignment(frame), cache, layout_for(cache.dtype), shape=shape, block_ids=ids,
                block_elems=_block_elems(cache)):
            return
    _decode_blocks_parsed(frame, cache, block_ids)


def start_encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                        codebook: Codebook | None = None) -> Pending[torch.Tensor]:
    """``encode_blocks`` launched on the current stream where the GPU can code the blocks with
    ``codebook``: the frame once the stream has run, without blocking the caller meanwhile.
    Elsewhere it runs ``encode_blocks`` now."""
    if not (_blocks_on_gpu(cache, DEFAULT_CHUNK) and codebook is not None):
        return Pending.done(encode_blocks(cache, block_ids, codebook))
    layout = _check_tensor(cache)
    ids = checked_block_ids(block_ids, cache, check=False)  # checked on the device
    book = _codebook_for(cache, codebook, layout, DEFAULT_CHUNK)
    return splitzip_gpu.start_encode(cache, ids, _block_elems(cache), (ids.numel(), *cache.shape[1:]), layout,
                                     book.exponents, DEFAULT_CHUNK)


def start_decode_blocks(frame: torch.Tensor, cache: torch.Tensor,
                        block_ids: Sequence[int] | torch.Tensor) -> Pending[None]:
    """``decode_blocks`` launched on the current stream where the GPU checks the frame itself:
    done once the stream has run (raising as ``decode_blocks`` does), without blocking the caller
    meanwhile. A frame the GPU declines (a stored one, say) is decoded on the host's terms when
    the result is asked for, on the stream current then; elsewhere ``decode_blocks`` runs now."""
    if _unparsed_on_gpu(frame, cache) and _blocks_on_gpu(cache, 8) and cache.dim() <= MAX_NDIM:
        ids = checked_block_ids(block_ids, cache, check=False)  # checked on the device
        if ids.numel():
            def declined(taken: bool) -> None:
                if not taken:
                    _decode_blocks_parsed(frame, cache, block_ids)
                    torch.cuda.current_stream(cache.device).synchronize()

            return splitzip_gpu.start_decode_unparsed(
                splitzip_gpu.check_alignment(frame), cache, layout_for(cache.dtype),
                shape=(ids.numel(), *cache.shape[1:]), block_ids=ids, block_elems=_block_elems(cache)).then(declined)
    decode_blocks(frame, cache, block_ids)
    return Pending.done(None)


def _decode_blocks_parsed(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
    """``decode_blocks`` with the header parsed on the host."""
    header = read_header(frame)
    # Coded frames on the GPU: the validation kernel checks the ids along with the streams.
    on_gpu = (header.codec == FrameCodec.SPLITZIP and _blocks_on_gpu(cache, header.chunk)
              and frame.device == cache.device)
    ids = checked_block_ids(block_ids, cache, unique=True, check=not on_gpu)
    expected = (ids.numel(), *cache.shape[1:])
    if header.layout.dtype != cache.dtype or header.shape != expected:
        raise OutputMismatch(f"frame holds {header.layout.name}{list(header.shape)}, blocks need "
                             f"{str(cache.dtype).removeprefix('torch.')}{list(expected)}")
    _verify_stream_crc(frame, header)
    if on_gpu:
        splitzip_gpu.decode_into(splitzip_gpu.check_alignment(frame), header, cache, ids, _block_elems(cache))
        return
    blocks = _decode_validated(frame, header)
    bits = header.layout.int_dtype  # index_copy_ lacks float8 kernels; the bits are what matter
    cache.view(bits).index_copy_(0, ids.to(cache.device), blocks.to(cache.device).view(bits))


def _encode(x: torch.Tensor, book: Codebook | None, *, checksum: bool, chunk: int, force: FrameCodec | None) -> torch.Tensor:
    """The torch reference encoder (any device), with the codec choice overridable so tests
    reach the escape path on data where storing would win."""
    layout = _check_tensor(x)
    if force == FrameCodec.STORED:
        return _frame(x, make_header(FrameCodec.STORED, layout, tuple(x.shape), 0, (), 0),
                      [x.reshape(-1).view(torch.uint8)], checksum)
    if book is None:
        book = calibrate(x)
    exponent, residual = split(as_bits(x, layout), layout)
    if layout.code_bits == 4:
        codes, escapes = splitzip.pair_encode(exponent, book.exponents, chunk, layout)
    else:
        marked = splitzip.marked_codes(exponent, book.exponents, layout)
        escapes = splitzip.find_escapes(exponent, marked, chunk, layout)
        codes = None  # packed only if the frame is coded
    count = escapes.index.numel()
    shape = tuple(x.shape)
    smaller = splitzip_size(layout, x.numel(), chunk, count) < stored_size(layout, x.numel())
    if force == FrameCodec.SPLITZIP or (force is None and smaller):
        if codes is None:
            codes = bitpack.pack(marked & (layout.codebook_size - 1), layout.code_bits)
        header = make_header(FrameCodec.SPLITZIP, layout, shape, chunk, book.exponents, count)
        streams = splitzip.encode_streams(residual, codes, escapes, layout)
    else:
        header = make_header(FrameCodec.STORED, layout, shape, 0, (), 0)
        streams = [x.reshape(-1).view(torch.uint8)]
    return _frame(x, header, streams, checksum)


def _frame(x: torch.Tensor, header: Header, streams: list[torch.Tensor], checksum: bool) -> torch.Tensor:
    frame = torch.zeros(header.total, dtype=torch.uint8, device=x.device)
    for offset, stream in zip(header.offsets, streams):
        frame[offset:offset + stream.numel()] = stream
    if checksum:
        header = replace(header, stream_crc=_stream_crc(frame))
    frame[:HEADER_SIZE] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return frame


def decode(frame: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a frame into a new tensor of the original dtype and shape on ``frame.device``,
    or into ``out`` (same dtype and element count, any shape).

    Every field is validated before the first write, so a bad frame leaves ``out`` untouched.

    Raises:
        CorruptFrame: the frame is malformed, truncated, extended or fails a checksum.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    if out is not None and _unparsed_on_gpu(frame, out) and out.numel():
        # The GPU checks the header itself; the host parses it only if the GPU declines.
        if splitzip_gpu.decode_unparsed(splitzip_gpu.check_alignment(frame), out, layout_for(out.dtype)):
            return out
    header = read_header(frame)
    if out is not None and (out.dtype != header.layout.dtype or out.numel() != header.numel):
        raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds "
                             f"{header.layout.name}[{header.numel}]")
    _verify_stream_crc(frame, header)
    if _on_gpu(frame, header.chunk or 8):
        direct = out is not None and out.is_contiguous() and out.device == frame.device
        target = out if direct else torch.empty(header.shape, dtype=header.layout.dtype, device=frame.device)
        splitzip_gpu.decode_into(splitzip_gpu.check_alignment(frame), header, target)
        if out is None:
            return target
        if not direct:
            out.copy_(target.view(out.shape))
        return out
    result = _decode_validated(frame, header)
    if out is None:
        return result
    out.copy_(result.view(out.shape))
    return out


def read_header(frame: torch.Tensor) -> Header:
    """Validated header of a frame (reads only the header and the frame's size).

    Raises:
        CorruptFrame: not a 1-D uint8 tensor, or a header that fails validation.
    """
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise CorruptFrame("a frame is a 1-D torch.uint8 tensor")
    size = frame.numel()
    if frame.is_cuda:
        raw = read_to_host(frame, min(size, HEADER_SIZE), current_stream(frame.device)).tobytes()
    else:
        raw = frame[:HEADER_SIZE].numpy().tobytes()
    return parse_header(raw, size)


def _decode_validated(frame: torch.Tensor, header: Header) -> torch.Tensor:
    """Torch reference decode of a frame whose header (and stream CRC) passed."""
    streams = [frame[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    if header.codec == FrameCodec.STORED:
        return streams[Stream.RESIDUAL].clone().view(header.layout.dtype).view(header.shape)
    layout = header.layout
    escapes = splitzip.read_escapes(streams[Stream.CHUNK_COUNTS], streams[Stream.ESC_POSITIONS],
                                    streams[Stream.ESC_VALUES], header.numel, header.chunk,
                                    header.escapes, layout)
    flat = splitzip.decode_elements(streams[Stream.RESIDUAL], streams[Stream.CODES], escapes,
                                    header.codebook, header.numel, layout)
    return flat.view(header.shape)


_GPU_DTYPES = {layout.dtype for layout in LAYOUTS}


def _unparsed_on_gpu(frame: torch.Tensor, out: torch.Tensor) -> bool:
    """A frame the GPU can decode into ``out`` without the host reading its header first (the
    GPU checks it, and hands back whatever it does not take)."""
    return (isinstance(frame, torch.Tensor) and frame.dtype == torch.uint8 and frame.dim() == 1
            and frame.numel() >= HEADER_SIZE and frame.is_cuda and out.is_cuda and out.device == frame.device
            and out.is_contiguous() and out.dtype in _GPU_DTYPES and splitzip_gpu.available())


def _on_gpu(t: torch.Tensor, chunk: int) -> bool:
    return t.is_cuda and splitzip_gpu.supports(chunk) and splitzip_gpu.available()


def _codebook_for(x: torch.Tensor, codebook: Codebook | None, layout: FloatLayout, chunk: int) -> Codebook:
    if not 1 <= chunk <= MAX_CHUNK:
        raise InvalidArgument(f"chunk must be in 1..{MAX_CHUNK}, got {chunk}")
    if codebook is None:
        return calibrate(x)
    if codebook.dtype != layout.name:
        raise CodebookMismatch(f"codebook is for {codebook.dtype}, tensor is {layout.name}")
    return codebook


def _blocks_on_gpu(cache: torch.Tensor, chunk: int) -> bool:
    """The kernels address a cache by whole blocks of whole 8-element groups."""
    block_elems = _block_elems(cache)
    return _on_gpu(cache, chunk) and cache.is_contiguous() and block_elems % 8 == 0 and block_elems > 0


def _block_elems(cache: torch.Tensor) -> int:
    """Elements per block (0 for an empty cache), without indexing a tensor."""
    return cache.numel() // cache.shape[0] if cache.dim() and cache.shape[0] else 0


def checked_block_ids(block_ids: Sequence[int] | torch.Tensor, cache: torch.Tensor, *, unique: bool = False,
               check: bool = True) -> torch.Tensor:
    """Block ids as an int64 tensor on the cache's device; with ``check``, range-checked (and
    checked for repeats when ``unique``) with a single device-to-host read.

    Raises:
        BlockOutOfRange: an id outside the cache. OutputMismatch: a repeated id where ``unique``.
    """
    if (isinstance(block_ids, torch.Tensor) and block_ids.dtype == torch.int64 and block_ids.dim() == 1
            and block_ids.device == cache.device and block_ids.is_contiguous()):
        ids = block_ids  # already what the kernels read
    else:
        ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).to(cache.device).contiguous()
    blocks = cache.shape[0] if cache.dim() else 0
    if not ids.numel() or not check:
        return ids
    checks = [ids.min(), ids.max()]
    if unique:  # counting beats sorting: one pass, no torch.unique
        hits = torch.zeros(max(blocks, 1), dtype=torch.int32, device=ids.device)
        hits.index_add_(0, ids.clamp(0, max(blocks - 1, 0)), torch.ones_like(ids, dtype=torch.int32))
        checks.append(hits.max().to(torch.int64))
    low, high, *most = torch.stack(checks).tolist()
    if low < 0 or high >= blocks:
        raise BlockOutOfRange(f"block ids must be in 0..{blocks - 1}")
    if unique and most[0] > 1:
        raise OutputMismatch("block ids repeat")
    return ids


def _gather(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]`` through the same-width integer view: not every device has float8 kernels."""
    bits = layout_for(cache.dtype).int_dtype
    return cache.view(bits).index_select(0, ids).view(cache.dtype)


def _verify_stream_crc(frame: torch.Tensor, header: Header) -> None:
    if header.stream_crc is not None and _stream_crc(frame) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")


def _check_tensor(x: torch.Tensor) -> FloatLayout:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    layout = layout_for(x.dtype)
    if x.dim() > MAX_NDIM:
        raise UnsupportedTensor(f"rank {x.dim()} exceeds the format's maximum of {MAX_NDIM}")
    return layout


def _stream_crc(frame: torch.Tensor) -> int:
    return crc32c(frame[HEADER_SIZE:].cpu().numpy().data)

