"""tca-tbe decode on CUDA: the check and decode kernels of ``tcatbe_cuda.cu`` (CuPy/NVRTC,
compiled on first use), used instead of the Triton decode where CuPy is importable.

The Triton decode kernel gave each program a [tiles, bytes, elements] grid whose lanes read
SIGNMAN and FALLBACK bytes scattered over many tiles and wrote 2-byte elements: ~1,000 GB/s on
an H200 at best. Here a lane takes one byte of a tile's bit-planes (8 elements), so a warp's
loads and its 16-byte stores are contiguous, and the values are put together with byte permutes
whose selectors a few multiplies give (the source says how). With block ids the kernel writes
each element straight into its cache block; there is no decoded copy to scatter.

The header is checked on the device too (block 0 of the ``check`` kernel, the same rules as
``format.parse_header``), so a decode need not wait for the host to read it: the GPU idles
while the host does. A frame it declines (another codec, a stream CRC the host has not
verified, another element count, anything malformed) comes back as ``False`` with nothing
written, for the host to parse and raise its precise error or decode another way. The decode
kernel copies the verdict into mapped pinned memory, so the host's wait is the call's last step
on the GPU (no copy after the kernels).

Launches go to ``cuLaunchKernel`` with every argument as 8 little-endian bytes in a parameter
block reused per thread (a 32-bit parameter reads the low half), and each thread keeps its
scratch block (verdict slots, parameters, repeated-id bitmap) per device: the host's share of a
call is on the path of every decode (H200, 1 GiB: ~0.03 ms of a 0.72 ms decode).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np
import torch

from ..errors import BlockOutOfRange, CorruptFrame, OutputMismatch
from ..launch import in_context, kernel_parameters, zero_async
from ..staging import current_stream, optional_cupy, read_to_host
from .format import GROUP_TILES, TILE, TcaTbeHeader, stream_lengths, stream_offsets

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
_ANY_SHAPE = (255, *[0] * 8)  # expected_ndim 255: any shape of n elements
assert GROUP_TILES % (RUNS * THREADS * 8 // TILE) == 0, "a decode block's span must lie inside a group"


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
    in_context(device_index, optional_cupy().cuda.driver.launchKernel, handle, grid, 1, 1, THREADS, 1, 1, 0, stream,
                kernel_parameters(args), 0)


def block_path_fits(cache: torch.Tensor) -> bool:
    """Whether the kernel can write whole blocks of ``cache`` (contiguous, blocks along dim 0) with
    16-byte stores: blocks of a multiple of 8 elements (under 2^31) at a 16-byte aligned address."""
    block_elems = cache[0].numel() if cache.dim() and cache.shape[0] else 0
    return (cache.is_contiguous() and block_elems % 8 == 0 and 0 < block_elems < 1 << 31
            and cache.data_ptr() % 16 == 0)


class _Scratch:
    """A thread's scratch block on one device (int64 words: the verdict's two int slots, the
    parameters, the repeated-id bitmap) and a mapped pinned int the decode kernel copies the
    verdict to. ``slot`` is the verdict slot the next call uses, zero at rest: each decode zeroes
    the other one for the call after. ``dirty``: a call launched and did not read its verdict
    (a launch failed), so the slots are zeroed before the next."""

    def __init__(self, device: torch.device, words: int) -> None:
        self.words = torch.zeros(max(words, 64), dtype=torch.int64, device=device)
        self.pinned = torch.zeros(2, dtype=torch.int32, pin_memory=True)  # mapped: device pointer == host pointer (UVA)
        self.host = self.pinned.numpy()
        self.slot = 0
        self.dirty = False


def _scratch(index: int, bitmap_words: int) -> _Scratch:
    """This thread's scratch block on device ``index`` with at least ``bitmap_words`` bitmap
    words: a call waits for its kernels before it returns, so the thread's next call may reuse it."""
    held = getattr(_thread, "scratch", None)
    if held is None:
        held = _thread.scratch = {}
    words = 1 + P_WORDS + bitmap_words
    scratch = held.get(index)
    if scratch is None or scratch.words.numel() < words:
        scratch = held[index] = _Scratch(torch.device("cuda", index), words)
    return scratch


_tuned: list = [None, ()]  # (the TUNING dict, its sorted items): the bench swaps in other dicts


def _tuning() -> tuple[tuple[str, int], ...]:
    """TUNING as a hashable key, sorted once per dict rather than per call (reassign TUNING to
    change it, as the bench does; do not mutate it)."""
    if _tuned[0] is not TUNING:
        _tuned[:] = TUNING, tuple(sorted(TUNING.items()))
    return _tuned[1]


@functools.lru_cache(maxsize=64)
def _leading(n: int) -> tuple[int, int, int]:
    """Offsets of GROUPS and TILES in a frame of ``n`` elements, and where TILES ends: the first
    three streams' places depend on n alone (BITMAPS starts at the header's end), so the check
    kernel takes them from the host and reads no offset the header could make point elsewhere."""
    lengths = stream_lengths(n, 0)  # the first three streams' lengths do not depend on in_window
    offsets, _ = stream_offsets(lengths)
    return offsets[1], offsets[2], offsets[2] + lengths[2]


def _launch_check(frame: torch.Tensor, index: int, n: int, stream: int, tuning: tuple[tuple[str, int], ...],
                  shape: tuple[int, ...] | None, block_ids: torch.Tensor | None, nblocks: int,
                  crc_verified: bool) -> _Scratch | None:
    """Launch the check kernel (header and streams) on a 16-byte aligned frame expected to hold
    ``n`` elements (of ``shape`` where given; and ``block_ids``, ids of a cache of ``nblocks``
    blocks); returns the scratch block, its verdict slot ``slot``. None, with nothing launched,
    where the frame is too short for the streams of ``n`` elements (the header check would
    decline it)."""
    groups, tiles_at, end = _leading(n)
    size = frame.numel()
    if size < end:
        return None
    nids = 0 if block_ids is None else block_ids.numel()
    bitmap_words = -(-nblocks // 64) if nids else 0
    scratch = _scratch(index, bitmap_words)
    base = scratch.words.data_ptr()
    if scratch.dirty:
        scratch.words.zero_()
        scratch.slot, scratch.dirty = 0, False
    if bitmap_words:
        zero_async(index, base + 8 * (1 + P_WORDS), 8 * bitmap_words, stream)
    expected = _ANY_SHAPE if shape is None else (len(shape), *shape, *[0] * (8 - len(shape)))
    tiles = -(-n // TILE)
    threads = max(-(-tiles // _knob(tuning, "CHECK_TILES")), nids)  # a thread per CHECK_TILES tiles, and per id
    ids = (block_ids.data_ptr(), nids, nblocks) if nids else (0, 0, 0)
    scratch.dirty = True
    _launch(index, "check", -(-threads // THREADS), stream,
            (frame.data_ptr(), size, n, WIRE_ID, *expected, int(crc_verified), base, base + 4 * scratch.slot, *ids,
             groups, tiles_at), tuning)
    return scratch


def _knob(tuning: tuple[tuple[str, int], ...], key: str) -> int:
    """One knob of a ``_tuning()`` key (a scan of four pairs: cheaper than a dict per call)."""
    for name, value in tuning:
        if name == key:
            return value
    raise KeyError(key)


def _verdict(bits: int) -> bool:
    """False if the header check declined the frame.

    Raises:
        BlockOutOfRange, OutputMismatch, CorruptFrame: what the check kernel found.
    """
    if bits & _HOST:
        return False
    if bits & _BAD_ID:
        raise BlockOutOfRange("block ids outside the cache")
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
    index = frame.get_device()
    stream = current_stream(frame.device)
    scratch = _launch_check(frame, index, header.numel, stream, _tuning(), None, None, 0, True)
    if scratch is None:
        raise CorruptFrame("the frame is shorter than its streams")
    bits = int(read_to_host(scratch.words, 4, stream, 4 * scratch.slot).view(np.int32)[0])
    scratch.words.view(torch.int32)[scratch.slot].zero_()  # no decode kernel to zero it
    scratch.dirty = False
    if not _verdict(bits):
        raise CorruptFrame("the device's header check rejected a header the host accepted")


def decode_into(frame: torch.Tensor, out: torch.Tensor, n: int, *, shape: tuple[int, ...] | None = None,
                block_ids: torch.Tensor | None = None, crc_verified: bool = False) -> bool:
    """Check a frame (header and streams, on the device) and decode it into the contiguous
    bfloat16 ``out`` of ``n`` (> 0) elements, or with ``block_ids`` (int64, contiguous, on the
    device; checked in the same pass) into blocks ``block_ids`` of the cache ``out``
    (``block_path_fits``), the frame then holding ``shape``. The check kernel leaves a verdict on
    the device that the decode kernel reads first and copies to mapped host memory; the one wait
    comes after both kernels, and no copy follows it.

    Returns:
        False, with nothing written, if the header is not one this path takes: not a tca-tbe
        frame of ``n`` elements (of ``shape``), malformed, or with a stream CRC unless
        ``crc_verified`` (the caller checked it).

    Raises:
        CorruptFrame: the streams disagree. BlockOutOfRange: a block id outside the cache.
            OutputMismatch: block ids repeat. Nothing is written then.
    """
    if frame.data_ptr() % 16:  # a frame cut from a receive buffer: the kernels read aligned words
        frame = frame.clone()
    index = frame.get_device()
    stream = torch._C._cuda_getCurrentRawStream(index)  # staging.current_stream, given the device's index
    tuning = _tuning()
    nblocks = out.shape[0] if block_ids is not None else 0
    scratch = _launch_check(frame, index, n, stream, tuning, shape, block_ids, nblocks, crc_verified)
    if scratch is None:
        return False
    span = RUNS * THREADS  # bytes of 8 elements a block decodes at a time
    blocks = (0, 0, 0) if block_ids is None else (block_ids.data_ptr(), out[0].numel(), out.stride(0))
    minb = _knob(tuning, "MINB_BLOCKS" if block_ids is not None else "MINB")
    grid = min(-(-((n + 7) // 8) // span), minb * _sms(index))
    base, slot = scratch.words.data_ptr(), scratch.slot
    _launch(index, "decode<true>" if block_ids is not None else "decode<false>", grid, stream,
            (frame.data_ptr(), base, base + 4 * slot, base + 4 * (1 - slot), scratch.pinned.data_ptr(),
             out.data_ptr(), *blocks, RUNS), tuning)
    optional_cupy().cuda.runtime.streamSynchronize(stream)
    bits = int(scratch.host[0])
    scratch.slot, scratch.dirty = 1 - slot, False
    return _verdict(bits)
