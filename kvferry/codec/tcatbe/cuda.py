"""tca-tbe decode on CUDA: the check and decode kernels of ``tcatbe_cuda.cu`` (CuPy/NVRTC,
compiled on first use), used instead of the Triton decode where CuPy is importable.

The Triton decode kernel gave each program a [tiles, bytes, elements] grid whose lanes read
SIGNMAN and FALLBACK bytes scattered over many tiles and wrote 2-byte elements: ~1,000 GB/s on
an H200 at best. Here a lane takes one byte of a tile's bit-planes (8 elements), so a warp's
loads and its 16-byte stores are contiguous, and the values are put together with byte permutes
from per-block tables (the source says how). With block ids the kernel writes each element
straight into its cache block; there is no decoded copy to scatter.

Launches go to ``cuLaunchKernel`` with every argument as 8 little-endian bytes in a parameter
block reused per thread (a 32-bit parameter reads the low half): the host's share of a call is
on the path of every decode, since the GPU idles between the header read and the launches.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from ..errors import CorruptFrame, OutputMismatch
from ..splitzip_gpu import _in_context, _parameters
from ..staging import current_stream, optional_cupy, read_to_host
from .format import GROUP_TILES, TILE, TcaTbeHeader, padding_ranges

THREADS = 256  # the source's THREADS
# Compile-time choices of the decode kernel, the source's TCA_* macros (bench/tcatbe_gpu_check.py
# --cuda-configs sweeps them): the register cap (MINB blocks per SM, also the blocks launched per
# SM: they stay and take spans in turn), evict-first output stores (STORE_CS). H200, 1 GiB: 5
# blocks of 8 bytes a lane 1,377 GB/s, 4 blocks 1,294, write-back stores -6% (bench/RESULTS.md).
TUNING = {"MINB": 5, "STORE_CS": 1}
RUNS = 8  # bytes a lane decodes per span (of RUNS * THREADS bytes: its tiles must divide a group's 1024)
_SOURCE = Path(__file__).with_name("tcatbe_cuda.cu")


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


def _launch(device_index: int, name: str, grid: int, stream: int, args: tuple[int, ...]) -> None:
    handle, _ = _function(device_index, name, tuple(sorted(TUNING.items())))
    _in_context(device_index, optional_cupy().cuda.driver.launchKernel, handle, grid, 1, 1, THREADS, 1, 1, 0, stream,
                _parameters(args), 0)


def block_path_fits(cache: torch.Tensor) -> bool:
    """Whether the kernel can write whole blocks of ``cache`` (contiguous, blocks along dim 0) with
    16-byte stores: blocks of a multiple of 8 elements at a 16-byte aligned address."""
    block_elems = cache[0].numel() if cache.dim() and cache.shape[0] else 0
    return cache.is_contiguous() and block_elems % 8 == 0 and block_elems > 0 and cache.data_ptr() % 16 == 0


_BAD_FRAME, _BAD_ID, _REPEATED_ID = 1, 2, 4  # the check kernel's flag bits
def _launch_check(frame: torch.Tensor, header: TcaTbeHeader, stream: int, block_ids: torch.Tensor | None = None,
                  nblocks: int = 0) -> torch.Tensor:
    """Launch the check kernel on a 16-byte aligned frame (and on ``block_ids``, ids of a cache of
    ``nblocks`` blocks); returns the device flag (int32, its bits say what was wrong), followed by
    the scratch bit per block that finds repeated ids."""
    nids = 0 if block_ids is None else block_ids.numel()
    flag = torch.empty(1 + (-(-nblocks // 32) if nids else 0), dtype=torch.int32, device=frame.device)
    optional_cupy().cuda.runtime.memsetAsync(flag.data_ptr(), 0, 4 * flag.numel(), stream)
    base = frame.data_ptr()
    gaps = [v for r in padding_ranges(header) for v in r]
    ids = (block_ids.data_ptr(), nids, nblocks, flag.data_ptr() + 4) if nids else (0, 0, 0, 0)
    _launch(frame.device.index, "check", -(-max(header.tiles, nids, 1) // THREADS), stream,
            (base + header.offsets[0], base + header.offsets[1], base + header.offsets[2], base, flag.data_ptr(),
             header.numel, header.tiles, header.in_window, *gaps, *[0] * (8 - len(gaps)), *ids))
    return flag


def _raise_if_bad(flag: torch.Tensor, stream: int) -> None:
    bits = int(read_to_host(flag, 4, stream).view(np.int32)[0])
    if bits & _BAD_ID:
        raise IndexError("block ids outside the cache")
    if bits & _REPEATED_ID:
        raise OutputMismatch("block ids repeat")
    if bits:
        raise CorruptFrame("tile offsets, bitmaps or padding disagree (the streams are inconsistent)")


def check(frame: torch.Tensor, header: TcaTbeHeader) -> None:
    """Check the streams of a frame whose header passed (the stream CRC is the caller's).

    Raises:
        CorruptFrame: offsets the bitmaps contradict, codes past the end, non-zero padding.
    """
    if header.tiles:
        stream = current_stream(frame.device)
        _raise_if_bad(_launch_check(frame if frame.data_ptr() % 16 == 0 else frame.clone(), header, stream), stream)


def decode_into(frame: torch.Tensor, header: TcaTbeHeader, out: torch.Tensor,
                block_ids: torch.Tensor | None = None) -> None:
    """Check the streams of a frame whose header passed, then decode it into the contiguous
    bfloat16 ``out`` (``header.numel`` elements), or with ``block_ids`` (int64, contiguous, on the
    device; checked here, in the same kernel) into blocks ``block_ids`` of the cache ``out``
    (``block_path_fits``). The check leaves a flag on the device that the decode kernel reads
    first; the one wait comes after both.

    Raises:
        CorruptFrame: as ``check``. IndexError: a block id outside the cache. OutputMismatch: block
            ids repeat. Nothing is written then.
    """
    n = header.numel
    if not header.tiles:
        return
    if frame.data_ptr() % 16:  # a frame cut from a receive buffer: the kernels read aligned words
        frame = frame.clone()
    stream = current_stream(frame.device)
    flag = _launch_check(frame, header, stream, block_ids, out.shape[0] if block_ids is not None else 0)
    span = RUNS * THREADS  # bytes of 8 elements a block decodes at a time
    assert GROUP_TILES % (span * 8 // TILE) == 0, "a block's span must lie inside a group"
    blocks = (0, 0, 0) if block_ids is None else (block_ids.data_ptr(), out[0].numel(), out.stride(0))
    base = frame.data_ptr()
    grid = min(-(-((n + 7) // 8) // span), TUNING["MINB"] * _sms(frame.device.index))
    _launch(frame.device.index, "decode<true>" if block_ids is not None else "decode<false>", grid, stream,
            (*(base + o for o in header.offsets), out.data_ptr(), *blocks, flag.data_ptr(), n, header.window_low,
             RUNS))
    _raise_if_bad(flag, stream)
