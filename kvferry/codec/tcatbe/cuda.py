"""tca-tbe decode on CUDA: the header, check and decode kernels of ``tcatbe_cuda.cu`` (CuPy/NVRTC,
compiled on first use), used instead of the Triton decode where CuPy is importable.

The Triton decode kernel gave each program a [tiles, bytes, elements] grid whose lanes read
SIGNMAN and FALLBACK bytes scattered over many tiles and wrote 2-byte elements: ~1,000 GB/s on
an H200 at best. Here a lane takes one byte of a tile's bit-planes (8 elements), so a warp's
loads and its 16-byte stores are contiguous, and the values are put together with byte permutes
whose selectors a few multiplies give (the source says how). With block ids the kernel writes
each element straight into its cache block; there is no decoded copy to scatter.

The header is checked on the device too (the ``header`` kernel, the same rules as
``format.parse_header``), so a decode need not wait for the host to read it: the GPU idles
while the host does. A frame that kernel declines (another codec, a stream CRC the host has
not verified, another element count, anything malformed) comes back as ``False`` with nothing
written, for the host to parse and raise its precise error or decode another way.

Launches go to ``cuLaunchKernel`` with every argument as 8 little-endian bytes in a parameter
block reused per thread (a 32-bit parameter reads the low half), and each thread keeps its
scratch block (verdict, parameters, repeated-id bitmap) per device: the host's share of a call
is on the path of every decode.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np
import torch

from ..errors import CorruptFrame, OutputMismatch
from ..splitzip_gpu import _in_context, _parameters
from ..staging import current_stream, optional_cupy, read_to_host
from .format import GROUP_TILES, TILE, TcaTbeHeader

THREADS = 256  # the source's THREADS
# Compile-time choices of the kernels, the source's TCA_* macros (bench/tcatbe_gpu_check.py
# --cuda-configs sweeps them): the decode kernel's register cap (MINB blocks per SM, also the
# blocks launched per SM: they stay and take spans in turn; MINB_BLOCKS with block ids),
# evict-first output stores (STORE_CS), tiles a check thread takes (CHECK_TILES). H200, 1 GiB of
# real KV: MINB 6 0.61 ms of decode kernel, 5 0.65-0.69 (its load latency hides better with more
# warps; 8 spills), with block ids 5 (6 spills: 0.93 ms against 0.73).
TUNING = {"MINB": 6, "MINB_BLOCKS": 5, "STORE_CS": 1, "CHECK_TILES": 4}
RUNS = 8  # bytes a lane decodes per span (of RUNS * THREADS bytes: its tiles must divide a group's 1024)
WIRE_ID = 1  # bfloat16, the one dtype
P_WORDS = 17  # the source's P_WORDS: u64 parameters after the verdict word
_SOURCE = Path(__file__).with_name("tcatbe_cuda.cu")
_BAD_FRAME, _BAD_ID, _REPEATED_ID, _HOST = 1, 2, 4, 8  # the verdict's bits (the source's Flag)
_thread = threading.local()


@functools.cache
def available() -> bool:
    """True when CUDA and CuPy are both usable."""
    return optional_cupy() is not None and torch.cuda.is_available()


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _module(device_index: int, tuning: tuple[tuple[str, int], ...]):
    cupy = optional_cupy()
    options = ("-std=c++17", *(f"-DTCA_{key}={value}" for key, value in tuning))
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=options,
                                name_expressions=["decode<false>", "decode<true>"])
        module.compile()
    return module


@functools.cache
def _function(device_index: int, name: str, tuning: tuple[tuple[str, int], ...]) -> tuple[int, object]:
    """(the CUfunction, CuPy's RawKernel that keeps its module loaded)."""
    function = _module(device_index, tuning).get_function(name)
    with optional_cupy().cuda.Device(device_index):
        return function.kernel.ptr, function


def _launch(device_index: int, name: str, grid: int, stream: int, args: tuple[int, ...],
            tuning: tuple[tuple[str, int], ...]) -> None:
    handle, _ = _function(device_index, name, tuning)
    _in_context(device_index, optional_cupy().cuda.driver.launchKernel, handle, grid, 1, 1, THREADS, 1, 1, 0, stream,
                _parameters(args), 0)


def block_path_fits(cache: torch.Tensor) -> bool:
    """Whether the kernel can write whole blocks of ``cache`` (contiguous, blocks along dim 0) with
    16-byte stores: blocks of a multiple of 8 elements (under 2^31) at a 16-byte aligned address."""
    block_elems = cache[0].numel() if cache.dim() and cache.shape[0] else 0
    return (cache.is_contiguous() and block_elems % 8 == 0 and 0 < block_elems < 1 << 31
            and cache.data_ptr() % 16 == 0)


def _scratch(device: torch.device, bitmap_words: int) -> torch.Tensor:
    """This thread's scratch block on ``device`` (verdict word, parameters, then at least
    ``bitmap_words`` u64 words): a call waits for its kernels before it returns, so the next call
    of the thread may reuse it."""
    held = getattr(_thread, "scratch", None)
    if held is None:
        held = _thread.scratch = {}
    words = 1 + P_WORDS + bitmap_words
    scratch = held.get(device.index)
    if scratch is None or scratch.numel() < words:
        scratch = held[device.index] = torch.empty(max(words, 64), dtype=torch.int64, device=device)
    return scratch


def _launch_checks(frame: torch.Tensor, n: int, stream: int, tuning: tuple[tuple[str, int], ...],
                   shape: tuple[int, ...] | None, block_ids: torch.Tensor | None, nblocks: int,
                   crc_verified: bool) -> torch.Tensor:
    """Launch the header and check kernels on a 16-byte aligned frame expected to hold ``n``
    elements (of ``shape`` where given; and ``block_ids``, ids of a cache of ``nblocks`` blocks);
    returns the scratch block, whose first word becomes the verdict."""
    nids = 0 if block_ids is None else block_ids.numel()
    bitmap_words = -(-nblocks // 64) if nids else 0
    device = frame.device
    scratch = _scratch(device, bitmap_words)
    index, base = device.index, scratch.data_ptr()
    expected = (255, *[0] * 8) if shape is None else (len(shape), *shape, *[0] * (8 - len(shape)))
    _launch(index, "header", 1, stream, (frame.data_ptr(), frame.numel(), n, WIRE_ID, *expected, int(crc_verified),
                                         base, bitmap_words), tuning)
    tiles = -(-n // TILE)
    threads = max(-(-tiles // dict(tuning)["CHECK_TILES"]), nids)  # a thread per CHECK_TILES tiles, and per id
    grid = -(-threads // THREADS)
    ids = (block_ids.data_ptr(), nids, nblocks) if nids else (0, 0, 0)
    _launch(index, "check", grid, stream, (frame.data_ptr(), base, *ids), tuning)
    return scratch


def _verdict(scratch: torch.Tensor, stream: int) -> bool:
    """Wait for the kernels; False if the header kernel declined the frame.

    Raises:
        IndexError, OutputMismatch, CorruptFrame: what the check kernel found.
    """
    bits = int(read_to_host(scratch, 4, stream).view(np.int32)[0])
    if bits & _HOST:
        return False
    if bits & _BAD_ID:
        raise IndexError("block ids outside the cache")
    if bits & _REPEATED_ID:
        raise OutputMismatch("block ids repeat")
    if bits:
        raise CorruptFrame("tile offsets, bitmaps or padding disagree (the streams are inconsistent)")
    return True


def check(frame: torch.Tensor, header: TcaTbeHeader) -> None:
    """Check the streams of a frame whose header passed (the stream CRC is the caller's).

    Raises:
        CorruptFrame: offsets the bitmaps contradict, codes past the end, non-zero padding.
    """
    if not header.tiles:
        return
    frame = frame if frame.data_ptr() % 16 == 0 else frame.clone()
    stream = current_stream(frame.device)
    tuning = tuple(sorted(TUNING.items()))
    if not _verdict(_launch_checks(frame, header.numel, stream, tuning, None, None, 0, True), stream):
        raise CorruptFrame("the device's header check rejected a header the host accepted")


def decode_into(frame: torch.Tensor, out: torch.Tensor, n: int, *, shape: tuple[int, ...] | None = None,
                block_ids: torch.Tensor | None = None, crc_verified: bool = False) -> bool:
    """Check a frame (header and streams, on the device) and decode it into the contiguous
    bfloat16 ``out`` of ``n`` (> 0) elements, or with ``block_ids`` (int64, contiguous, on the
    device; checked in the same pass) into blocks ``block_ids`` of the cache ``out``
    (``block_path_fits``), the frame then holding ``shape``. The checks leave a verdict on the
    device that the decode kernel reads first; the one wait comes after all three kernels.

    Returns:
        False, with nothing written, if the header is not one this path takes: not a tca-tbe
        frame of ``n`` elements (of ``shape``), malformed, or with a stream CRC unless
        ``crc_verified`` (the caller checked it).

    Raises:
        CorruptFrame: the streams disagree. IndexError: a block id outside the cache.
            OutputMismatch: block ids repeat. Nothing is written then.
    """
    if frame.data_ptr() % 16:  # a frame cut from a receive buffer: the kernels read aligned words
        frame = frame.clone()
    stream = current_stream(frame.device)
    tuning = tuple(sorted(TUNING.items()))
    nblocks = out.shape[0] if block_ids is not None else 0
    scratch = _launch_checks(frame, n, stream, tuning, shape, block_ids, nblocks, crc_verified)
    span = RUNS * THREADS  # bytes of 8 elements a block decodes at a time
    assert GROUP_TILES % (span * 8 // TILE) == 0, "a block's span must lie inside a group"
    blocks = (0, 0, 0) if block_ids is None else (block_ids.data_ptr(), out[0].numel(), out.stride(0))
    grid = min(-(-((n + 7) // 8) // span), TUNING["MINB_BLOCKS" if block_ids is not None else "MINB"]
               * _sms(frame.device.index))
    _launch(frame.device.index, "decode<true>" if block_ids is not None else "decode<false>", grid, stream,
            (frame.data_ptr(), scratch.data_ptr(), out.data_ptr(), *blocks, RUNS), tuning)
    return _verdict(scratch, stream)
