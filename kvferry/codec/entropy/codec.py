"""``entropy``: the registry entry, frames assembled and taken apart around the Huffman coder.

CPU tensors go through the numpy reference (``reference.py``); CUDA tensors through the GPU
kernels when they are available (``gpu.py``), otherwise through the reference by way of host
copies. Either way the bytes are the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..dtypes import layout_for
from ..errors import CodebookMismatch, CorruptFrame, InvalidArgument, OutputMismatch, UnsupportedTensor
from ..format import FrameCodec, stored_size
from ..layout import BlockLayout
from ..frames import decode as decode_frame, checked_block_ids
from ..frames import encode_stored
from ..registry import Capabilities, PositionFree, codec_id as frame_codec_id
from ..staging import Pending
from . import reference
from .codebook import DEFAULT_TABLES, MAX_CONTEXTS, EntropyCodebook, calibrate, calibrate_blocks
from .format import (DEFAULT_CHUNK, FRAME_ID, HEADER_SIZE, LANES, MAX_CHUNK, EntropyHeader, Stream, check_counts,
                     make_header, pack_map, pack_raw, pack_tables, parse_header, parse_tables, unpack_raw)
from .huffman import code_tables
from .symbols import Geometry, element_bits, for_dtype


MIN_REGISTRY_CHUNK = 4096  # elements: a chunk costs its count and under a word a lane of padding
WARPS_WANTED = 2048  # chunks a frame should have: one warp each, half an H200's at a time


def chunk_for(numel: int) -> int:
    """Elements per chunk for the registry's frames of ``numel`` elements: the default, halved
    while that leaves a frame fewer than WARPS_WANTED chunks, down to MIN_REGISTRY_CHUNK. A chunk
    is one warp's serial work, so a small frame in few chunks leaves most of a GPU idle (16 MiB
    in chunks of 32768: 256 warps, ~20 GB/s); smaller chunks cost ratio (~1% at 4096)."""
    chunk = DEFAULT_CHUNK
    while chunk > MIN_REGISTRY_CHUNK and numel < chunk * WARPS_WANTED:
        chunk //= 2
    return chunk


def _check_tensor(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise UnsupportedTensor(f"expected a torch.Tensor, got {type(x).__name__}")
    layout_for(x.dtype)


def self_codebook(x: torch.Tensor) -> EntropyCodebook:
    """Codebook of ``x`` itself, for ``encode`` without one: per-channel contexts (last axis)
    when there are few enough channels, else a single table."""
    if x.dim() >= 2 and 1 <= x.shape[-1] <= 4096:
        return calibrate(x, token_axis=None)
    return calibrate(x.reshape(-1), token_axis=0)


def _prepare(book: EntropyCodebook, device: torch.device) -> None:
    """Build the code tables (on a GPU, its copies of them) that the first call with ``book``
    would build: an engine learns in a thread, and the first transfer with a codebook learned
    per position spent ~25 ms building them before its first byte (H100 host)."""
    ct = code_tables(book)
    if device.type == "cuda":
        from . import gpu

        if gpu.available():
            gpu.tables_ready(ct, device)


def _book_for(x: torch.Tensor, codebook: Any) -> EntropyCodebook:
    if codebook is None:
        return self_codebook(x)
    if not isinstance(codebook, EntropyCodebook):
        raise CodebookMismatch(f"the entropy codec needs an EntropyCodebook, got {type(codebook).__name__}")
    if codebook.dtype != layout_for(x.dtype).name:
        raise CodebookMismatch(f"codebook is for {codebook.dtype}, the tensor is {x.dtype}")
    return codebook


def encode(x: torch.Tensor, codebook: EntropyCodebook | None = None, *, checksum: bool = True,
           chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """One frame of ``x`` on ``x.device``: an entropy frame, or a stored frame (codec 0) if the
    entropy frame would not be smaller.

    Raises:
        UnsupportedTensor: a dtype the codec does not handle.
        CodebookMismatch: a codebook for another dtype.
    """
    _check_tensor(x)
    if not (LANES <= chunk <= MAX_CHUNK and chunk % LANES == 0):
        raise InvalidArgument(f"chunk must be a multiple of {LANES} in {LANES}..{MAX_CHUNK}")
    book = _book_for(x, codebook)
    if x.is_cuda:
        from . import gpu

        if gpu.available():
            frame = gpu.encode(x.detach().contiguous().reshape(-1), None, tuple(x.shape), book, checksum=checksum,
                               chunk=chunk)
            return frame if frame is not None else encode_stored(x, checksum=checksum)
    return encode_reference(x.detach().cpu(), book, checksum=checksum, chunk=chunk).to(x.device)


def encode_reference(x: torch.Tensor, book: EntropyCodebook, *, checksum: bool = True,
                     chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The frame as the reference writes it (CPU tensor in, CPU frame out)."""
    sym = for_dtype(x.dtype)
    bits = element_bits(x.contiguous())
    numel = bits.size
    ct = code_tables(book)
    counts, words = reference.encode_symbols((bits >> sym.raw_bits).astype(np.int64), ct, chunk)
    header = make_header(sym, tuple(x.shape), ct, chunk, words.size)
    if header.total >= stored_size(sym.layout, numel):
        return encode_stored(x, checksum=checksum)
    raw = pack_raw((bits & ((1 << sym.raw_bits) - 1)).astype(np.int64), chunk, sym.raw_bits).tobytes()
    streams = (pack_tables(ct), pack_map(ct), counts.tobytes(), words.tobytes(), raw)
    return assemble(header, streams, checksum)


def assemble(header: EntropyHeader, streams: Sequence[bytes], checksum: bool) -> torch.Tensor:
    """Header and streams laid out in one frame, the stream CRC filled in if asked for."""
    buf = np.zeros(header.total, dtype=np.uint8)
    for offset, length, data in zip(header.offsets, header.lengths, streams):
        assert len(data) == length, (length, len(data))
        buf[offset:offset + length] = np.frombuffer(data, dtype=np.uint8)
    if checksum:
        header = header.with_crc(crc32c(memoryview(buf[HEADER_SIZE:])))
    buf[:HEADER_SIZE] = np.frombuffer(header.pack(), dtype=np.uint8)
    return torch.from_numpy(buf)



def read_header(frame: torch.Tensor) -> EntropyHeader:
    """Validated header of an entropy frame.

    Raises:
        CorruptFrame: not an entropy frame, or a header that fails validation.
    """
    if frame_codec_id(frame) != FRAME_ID:
        raise CorruptFrame("not an entropy frame")
    return parse_header(frame[:HEADER_SIZE].cpu().numpy().tobytes(), frame.numel())


def decode(frame: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor a frame holds (entropy or stored), on ``frame.device``, or written into ``out``
    (same dtype and element count, any shape). Everything is checked before ``out`` is touched.

    Raises:
        CorruptFrame: the frame is malformed, truncated, or fails a checksum.
        OutputMismatch: ``out`` has the wrong dtype or element count.
    """
    if isinstance(frame, torch.Tensor) and frame.is_cuda:
        from . import gpu

        if gpu.available():
            prefix = gpu.read_prefix(frame)  # one read: codec, header, tables
            if gpu.is_stored(prefix):
                return decode_frame(frame, out=out)
            header = gpu.header_of(frame, prefix)
            _check_out(header, out)
            return gpu.decode(frame, header, prefix, out)
    codec_id = frame_codec_id(frame)
    if codec_id == int(FrameCodec.STORED):
        return decode_frame(frame, out=out)
    if codec_id != FRAME_ID:
        raise CorruptFrame(f"codec id {codec_id} is not an entropy (or stored) frame")
    header = read_header(frame)
    _check_out(header, out)
    result = decode_reference(frame.cpu().numpy(), header).to(frame.device)
    return result if out is None else out.copy_(result.view(out.shape))


def _check_out(header: EntropyHeader, out: torch.Tensor | None) -> None:
    if out is not None and (out.dtype != header.sym.layout.dtype or out.numel() != header.numel):
        raise OutputMismatch(f"out is {out.dtype}[{out.numel()}], frame holds "
                             f"{header.sym.layout.name}[{header.numel}]")


def decode_reference(buf: np.ndarray, header: EntropyHeader) -> torch.Tensor:
    """Reference decode of a frame (as numpy bytes) whose header passed ``parse_header``."""
    if header.stream_crc is not None and crc32c(memoryview(buf[HEADER_SIZE:])) != header.stream_crc:
        raise CorruptFrame("stream checksum mismatch")
    s = [buf[o:o + n] for o, n in zip(header.offsets, header.lengths)]
    padding = np.ones(buf.size, dtype=bool)
    padding[:HEADER_SIZE] = False
    for o, n in zip(header.offsets, header.lengths):
        padding[o:o + n] = False
    if buf[padding].any():
        raise CorruptFrame("padding between streams is not zero")
    ct = parse_tables(header, s[Stream.TABLES].tobytes(), s[Stream.MAP].tobytes())
    counts = s[Stream.COUNTS].view("<u4")
    starts = check_counts(header, counts)
    sym, n = header.sym, header.numel
    symbols = reference.decode_symbols(counts, starts, s[Stream.WORDS].view("<u4"), ct, n, header.chunk)
    bits = symbols << sym.raw_bits
    if sym.raw_bits:
        bits |= unpack_raw(s[Stream.RAW].view("<u4"), n, header.chunk, sym.raw_bits)
    dtype = np.uint16 if sym.layout.total_bits == 16 else np.uint8
    flat = torch.from_numpy(bits.astype(dtype).view(np.int16 if dtype == np.uint16 else np.uint8))
    return flat.view(sym.layout.dtype).view(header.shape)



def encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                  codebook: EntropyCodebook | None = None, *, checksum: bool = True,
                  chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Frame of ``cache[block_ids]`` (blocks along dim 0): the same bytes as ``encode`` of them."""
    _check_tensor(cache)
    if not (LANES <= chunk <= MAX_CHUNK and chunk % LANES == 0):
        raise InvalidArgument(f"chunk must be a multiple of {LANES} in {LANES}..{MAX_CHUNK}")
    pending = _launch_encode(cache, block_ids, codebook, checksum, chunk)
    if pending is not None:  # the coder reads the blocks in place, their ids checked on the device
        frame = pending.result()
        if frame is not None:
            return frame
    ids = checked_block_ids(block_ids, cache)
    bits = layout_for(cache.dtype).int_dtype  # index_select lacks float8 kernels
    blocks = cache.view(bits).index_select(0, ids).view(cache.dtype)
    return encode(blocks, codebook, checksum=checksum, chunk=chunk)


def decode_blocks(frame: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
    """Write the frame's blocks into ``cache[block_ids]``; nothing is written if it is bad.

    Raises:
        CorruptFrame: the frame is malformed (nothing written).
        OutputMismatch: the frame's dtype or block shape differs from the cache's, or ids repeat.
        BlockOutOfRange: a block id outside the cache.
    """
    _check_tensor(cache)
    pending = _launch_decode(frame, cache, block_ids)
    if pending is not None:  # the GPU writes the blocks, their ids checked on the device
        pending.result()
        return
    ids = checked_block_ids(block_ids, cache, unique=True)
    expected = (ids.numel(), *cache.shape[1:])
    gpu = None
    if isinstance(frame, torch.Tensor) and frame.is_cuda and frame.device == cache.device:
        from . import gpu

        if not gpu.available():
            gpu = None
    if gpu is not None:
        prefix = gpu.read_prefix(frame)  # one read: codec, header, tables
        stored = gpu.is_stored(prefix)
    else:
        stored = frame_codec_id(frame) == int(FrameCodec.STORED)
    if stored:
        blocks = decode_frame(frame)
    else:
        header = gpu.header_of(frame, prefix) if gpu is not None else read_header(frame)
        _check_blocks(header, cache, expected)
        if gpu is not None:
            gpu.decode_blocks(frame, header, prefix, cache, ids)
            return
        blocks = decode(frame)
    if blocks.dtype != cache.dtype or tuple(blocks.shape) != expected:
        raise OutputMismatch(f"frame holds {blocks.dtype}{list(blocks.shape)}, blocks need "
                             f"{cache.dtype}{list(expected)}")
    bits = layout_for(cache.dtype).int_dtype
    cache.view(bits).index_copy_(0, ids, blocks.to(cache.device).view(bits))


def _check_blocks(header: EntropyHeader, cache: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raises OutputMismatch unless the frame holds blocks of ``cache``'s dtype, ``expected`` in all."""
    if header.sym.layout.dtype != cache.dtype or header.shape != expected:
        raise OutputMismatch(f"frame holds {header.sym.layout.name}{list(header.shape)}, blocks need "
                             f"{str(cache.dtype).removeprefix('torch.')}{list(expected)}")


def _launch_encode(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, codebook: EntropyCodebook | None,
                   checksum: bool, chunk: int) -> Pending[torch.Tensor | None] | None:
    """The GPU encode of ``cache[block_ids]`` launched (None where the GPU does not code these
    blocks in place): the frame, or None where a stored frame would not be larger, once the
    stream has run; the ids are checked on the device (BlockOutOfRange)."""
    if not (cache.is_cuda and codebook is not None):
        return None
    from . import gpu

    if not (gpu.available() and gpu.takes_blocks(cache)):
        return None
    ids = checked_block_ids(block_ids, cache, check=False)
    if not ids.numel():
        return None
    book = _book_for(cache, codebook)
    return gpu.start_encode(cache.detach(), ids, (ids.numel(), *cache.shape[1:]), book, checksum=checksum,
                            chunk=chunk, blocks=cache.shape[0])


def _launch_decode(frame: torch.Tensor, cache: torch.Tensor,
                   block_ids: Sequence[int] | torch.Tensor) -> Pending[None] | None:
    """The GPU decode of an entropy frame into ``cache[block_ids]`` launched after one read of
    its header (None where the GPU does not write these blocks itself, or the frame is a stored
    one): done once the stream has run, raising as ``decode_blocks`` does; the ids are checked
    on the device (BlockOutOfRange, OutputMismatch for repeats) and nothing is written unless every
    check passed."""
    if not (isinstance(frame, torch.Tensor) and frame.is_cuda and frame.device == cache.device and cache.dim()):
        return None
    from . import gpu

    if not (gpu.available() and gpu.scatters(cache, cache[0].numel() * cache.element_size())):
        return None
    prefix = gpu.read_prefix(frame)
    if gpu.is_stored(prefix):
        return None
    ids = checked_block_ids(block_ids, cache, check=False)
    header = gpu.header_of(frame, prefix)
    _check_blocks(header, cache, (ids.numel(), *cache.shape[1:]))
    return gpu.start_decode_blocks(frame, header, prefix, cache, ids) if ids.numel() else None


def start_encode_blocks(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor,
                        codebook: EntropyCodebook | None = None) -> Pending[torch.Tensor]:
    """``encode_blocks`` (no stream CRC, the registry's) launched on the current stream where the
    GPU codes the blocks in place: the frame once the stream has run, the block ids checked on
    the device, without blocking the caller meanwhile. Elsewhere it runs ``encode_blocks`` now."""
    _check_tensor(cache)
    chunk = _blocks_chunk(cache, block_ids)
    pending = _launch_encode(cache, block_ids, codebook, False, chunk)
    if pending is None:
        return Pending.done(encode_blocks(cache, block_ids, codebook, checksum=False, chunk=chunk))
    return pending.then(lambda frame: frame if frame is not None
                        else encode_blocks(cache, block_ids, codebook, checksum=False, chunk=chunk))


def _blocks_chunk(cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> int:
    count = block_ids.numel() if isinstance(block_ids, torch.Tensor) else len(block_ids)
    return chunk_for(count * (cache[0].numel() if cache.dim() and cache.shape[0] else 1))


def start_decode_blocks(frame: torch.Tensor, cache: torch.Tensor,
                        block_ids: Sequence[int] | torch.Tensor) -> Pending[None]:
    """``decode_blocks`` launched on the current stream where the GPU writes the blocks itself:
    done once the stream has run (raising as ``decode_blocks`` does; the block ids are checked
    on the device), without blocking the caller meanwhile, but for the read of the frame's
    header. Elsewhere, and for stored frames, ``decode_blocks`` runs now."""
    _check_tensor(cache)
    pending = _launch_decode(frame, cache, block_ids)
    if pending is not None:
        return pending
    decode_blocks(frame, cache, block_ids)
    return Pending.done(None)


class EntropyCodec(PositionFree):
    """Channel-aware static Huffman codes: sign+exponent (BF16/FP16) or the whole byte (FP8) coded with
    a table chosen per position in the block, the mantissa raw; a stored frame when that does
    not pay. Frames carry their tables, so decode needs no codebook.

    The registry entry (the engine's calls) writes frames without the stream CRC: the transport
    checks every payload already, and a host CRC of a GPU frame costs a device-to-host copy of
    it. The module-level ``encode`` still adds one by default. Its frames' chunk follows their
    size (``chunk_for``), so that small frames still keep a GPU busy."""

    name = "entropy"
    frame_id = FRAME_ID
    capabilities = Capabilities(lossless=True, standalone=True, learns=True, starts_blocks=True)

    def supports(self, dtype: torch.dtype) -> bool:
        try:
            layout_for(dtype)
        except UnsupportedTensor:
            return False
        return True

    def capacity(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        # An entropy frame is written only if it is smaller than the stored one.
        return stored_size(layout_for(dtype), int(np.prod(tuple(shape), dtype=np.int64)))

    def calibrate(self, samples: torch.Tensor | Sequence[torch.Tensor], *, token_axis: int | None = None,
                  axes: Sequence[str] | None = None,
                  tables: int = DEFAULT_TABLES) -> EntropyCodebook:
        """``calibrate``; samples whose first axis is named ``block`` (an engine's blocks) get one
        block as their period, and their ``token`` axis if named and ``token_axis`` is not."""
        if axes and axes[0] == "block" and isinstance(samples, torch.Tensor):
            if token_axis is None and "token" in axes:
                token_axis = list(axes).index("token")
            return calibrate_blocks(samples, token_axis=None if token_axis is None else token_axis - 1,
                                    tables=tables)
        return calibrate(samples, token_axis=token_axis, tables=tables)

    def learn(self, sample: torch.Tensor, layout: BlockLayout | None = None) -> EntropyCodebook:
        """What ``encode`` without a codebook would calibrate on ``sample`` (``[blocks, *block]``);
        with a ``layout`` that names the token axis, contexts are every other position of the
        block (its layers, K/V, heads and channels), where the KV's statistics differ."""
        token = layout.index("token") if layout is not None else None
        if token is not None and Geometry.of(layout.shape, token).contexts <= MAX_CONTEXTS:
            book = calibrate_blocks(sample, token_axis=token)
        else:
            book = self_codebook(sample)
        _prepare(book, sample.device)
        return book

    def codebook_from_json(self, text: str | bytes) -> EntropyCodebook:
        return EntropyCodebook.from_json(text)

    def encode(self, x: torch.Tensor, codebook: EntropyCodebook | None = None) -> torch.Tensor:
        return encode(x, codebook, checksum=False, chunk=chunk_for(x.numel()))

    def decode(self, frame: torch.Tensor, codebook: Any = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(frame, out=out)

    def encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: EntropyCodebook | None = None) -> torch.Tensor:
        return encode_blocks(cache, block_ids, codebook, checksum=False, chunk=_blocks_chunk(cache, block_ids))

    def decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                      codebook: Any = None) -> None:
        decode_blocks(frame, cache, block_ids)

    def start_encode_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: EntropyCodebook | None = None) -> Pending[torch.Tensor]:
        return start_encode_blocks(cache, block_ids, codebook)

    def start_decode_blocks(self, frame: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                            codebook: Any = None) -> Pending[None]:
        return start_decode_blocks(frame, cache, block_ids)
