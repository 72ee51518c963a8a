"""Whole blocks from one cache to another, ``dst[dst_ids] = src[src_ids]``: what a same-host write
under a lease is (the raw codec's encode and decode in one step).

On a GPU one kernel reads each source block once and writes it where it goes, into the same GPU
or a peer's memory: one pass, no temporary. torch's ``index_select`` + ``index_copy_`` (two passes
through a temporary, and one more over NVLink for a peer) is the reference and the path
everywhere else (the host, odd sizes, no CuPy, no peer access).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

from .dtypes import layout_for
from .launch import in_context, kernel_parameters
from .staging import current_stream, on_stream, optional_cupy

_SOURCE = r"""
// dst block dst_ids[b] = src block src_ids[b]: grid rows take blocks, grid columns pieces of a
// block; each thread has PER 16-byte loads in flight before its stores. A spread (count > 1):
// row b is id b / count spread by b % count strides, so only the ids cross to the GPU.
template <int PER>
__device__ void copy_rows(const int4* __restrict__ src, int4* __restrict__ dst,
                          const long long* __restrict__ src_ids, const long long* __restrict__ dst_ids,
                          long long blocks, long long vecs, long long count, long long src_stride,
                          long long dst_stride) {
    const long long step = (long long)PER * blockDim.x;
    for (long long b = blockIdx.y; b < blocks; b += gridDim.y) {
        const long long i = b / count, j = b - i * count;
        const int4* from = src + (src_ids[i] + j * src_stride) * vecs;
        int4* to = dst + (dst_ids[i] + j * dst_stride) * vecs;
        for (long long base = blockIdx.x * step + threadIdx.x; base < vecs; base += gridDim.x * step) {
            int4 v[PER];
            #pragma unroll
            for (int k = 0; k < PER; ++k) {
                if (base + k * blockDim.x < vecs) v[k] = from[base + k * blockDim.x];
            }
            #pragma unroll
            for (int k = 0; k < PER; ++k) {
                if (base + k * blockDim.x < vecs) to[base + k * blockDim.x] = v[k];
            }
        }
    }
}

extern "C" __global__ void copy_blocks(const int4* __restrict__ src, int4* __restrict__ dst,
                                       const long long* __restrict__ src_ids,
                                       const long long* __restrict__ dst_ids, long long blocks, long long vecs,
                                       long long count, long long src_stride, long long dst_stride) {
    copy_rows<1>(src, dst, src_ids, dst_ids, blocks, vecs, count, src_stride, dst_stride);
}

// Many small blocks (vLLM's 32 KiB pages), one CTA each (H200, 16,384 pages:
// 317 µs vs 375 for copy_blocks; a contiguous memcpy of the same bytes 265).
extern "C" __global__ void copy_pages(const int4* __restrict__ src, int4* __restrict__ dst,
                                      const long long* __restrict__ src_ids,
                                      const long long* __restrict__ dst_ids, long long blocks, long long vecs,
                                      long long count, long long src_stride, long long dst_stride) {
    copy_rows<4>(src, dst, src_ids, dst_ids, blocks, vecs, count, src_stride, dst_stride);
}
"""
# Blocks named in the launch itself (their u32 ids, 2 KiB of each side, inside the 4 KiB a
# kernel's arguments may take); longer lists go as index tensors.
LISTED_MAX = 256
_LISTED_SOURCE = r"""
struct Listed { unsigned int ids[LISTED_MAX]; };

// copy_blocks with the ids among the arguments (read where they are: __grid_constant__).
extern "C" __global__ void copy_listed_blocks(const int4* __restrict__ src, int4* __restrict__ dst,
                                              const __grid_constant__ Listed src_ids,
                                              const __grid_constant__ Listed dst_ids, long long blocks,
                                              long long vecs) {
    for (long long b = blockIdx.y; b < blocks; b += gridDim.y) {
        const int4* from = src + (long long)src_ids.ids[b] * vecs;
        int4* to = dst + (long long)dst_ids.ids[b] * vecs;
        for (long long v = blockIdx.x * blockDim.x + threadIdx.x; v < vecs; v += gridDim.x * blockDim.x) {
            to[v] = from[v];
        }
    }
}
"""
THREADS = 256
VEC = 16  # bytes a thread moves at once (int4)
PAGE_THREADS = 512
PAGE_VECS = 4 * PAGE_THREADS  # the largest block copy_pages moves (32 KiB)
PAGE_MIN_BLOCKS = 1024  # fewer blocks leave SMs idle with one CTA each: copy_blocks is faster there


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy blocks ``src[src_ids[k]]`` to ``dst[dst_ids[k]]`` (blocks along dim 0, the same block
    shape and dtype), on the caller's current stream of ``src``'s GPU; ids are int64 and already
    checked (in range, ``dst_ids`` without repeats)."""
    if _kernel_fits(src, dst):
        _launch(src, src_ids, dst, dst_ids)
        return
    bits = layout_for(src.dtype).int_dtype  # index_copy_ lacks float8 kernels; the bits are what matter
    blocks = src.view(bits).index_select(0, src_ids.to(src.device)).to(dst.device, non_blocking=True)
    dst.view(bits).index_copy_(0, dst_ids.to(dst.device), blocks)
    _joined(src, dst)


def copy_spread(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, count: int,
                src_stride: int, dst_stride: int) -> None:
    """``copy_blocks`` of spread ids: block ``i * count + j`` is ``src_ids[i] + j * src_stride``
    in ``src`` and ``dst_ids[i] + j * dst_stride`` in ``dst`` (checked already). On a GPU the kernel
    spreads the ids itself, so only ``ids`` cross to it (vLLM's request across 64 layer planes:
    256 ids, not 16,384 of each side)."""
    if _kernel_fits(src, dst):
        _launch(src, src_ids, dst, dst_ids, count, src_stride, dst_stride)
        return
    copy_blocks(src, spread(src_ids, count, src_stride), dst, spread(dst_ids, count, dst_stride))


def spread(ids: torch.Tensor, count: int, stride: int) -> torch.Tensor:
    """Every block of a spread, in ``copy_spread``'s order."""
    return (ids[:, None] + torch.arange(count, dtype=torch.int64, device=ids.device)[None, :] * stride).reshape(-1)


@dataclass(frozen=True)
class Route:
    """Where a listed copy goes between two fixed tensors, by the driver's copies or one kernel
    on ``device`` (the source's GPU): their base addresses and block size, worked out once (the
    checks behind them cost more than a block's copy call on the GPU hosts measured)."""

    source: int
    destination: int
    block_bytes: int
    device: int


def route(src: torch.Tensor, dst: torch.Tensor) -> Route | None:
    """``copy_listed``'s plan from ``src`` to ``dst``: a ``Route`` on GPUs that reach each other,
    None where torch's path serves (the host, odd sizes, no CuPy, no peer access)."""
    if not _kernel_fits(src, dst):
        return None
    return Route(src.data_ptr(), dst.data_ptr(), _block_bytes(src), src.device.index)


def copy_routed(route_: Route, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], stream: int) -> None:
    """``copy_listed`` along a ``Route`` (ids checked already): one ``cudaMemcpyAsync`` a block on
    the raw stream handle ``stream``."""
    copy, nbytes = optional_cupy().cuda.runtime.memcpyAsync, route_.block_bytes
    source, destination = route_.source, route_.destination
    for s, d in zip(src_ids, dst_ids):
        copy(destination + d * nbytes, source + s * nbytes, nbytes, _MEMCPY_DEFAULT, stream)


def copy_by_value(route_: Route, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], stream: int) -> bool:
    """``copy_blocks`` along a ``Route`` of at most ``LISTED_MAX`` listed blocks (ids checked
    already), in one kernel launched on the raw stream handle ``stream`` with the ids among its
    arguments: no index tensors, no copy of them to the GPU (building and staging those took most
    of a 256 MiB same-host write's time before its kernel). False, nothing launched, where that
    kernel is not there (the caller then takes the index path)."""
    function = _by_value(route_.device)
    n = len(src_ids)
    if function is None or not 0 < n <= LISTED_MAX or len(dst_ids) != n:
        return False
    vecs = route_.block_bytes // VEC
    grid = _block_grid(vecs, n)
    in_context(route_.device, optional_cupy().cuda.driver.launchKernel, function, *grid, 1, THREADS, 1, 1, 0,
               stream, _listed_arguments(route_.source, route_.destination, src_ids, dst_ids, vecs), 0)
    return True


class _ListedArguments(ctypes.Structure):
    """``copy_listed_blocks``'s arguments, each where its ``void*`` points (``cuLaunchKernel``
    copies them before it returns, so one block per thread is reused)."""

    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("src_ids", ctypes.c_uint32 * LISTED_MAX),
                ("dst_ids", ctypes.c_uint32 * LISTED_MAX), ("blocks", ctypes.c_int64), ("vecs", ctypes.c_int64),
                ("pointers", ctypes.c_void_p * 6)]


_listed_thread = threading.local()


def _listed_arguments(src: int, dst: int, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], vecs: int) -> int:
    held = getattr(_listed_thread, "arguments", None)
    if held is None:
        held = _listed_thread.arguments = _ListedArguments()
        base = ctypes.addressof(held)
        for i, name in enumerate(("src", "dst", "src_ids", "dst_ids", "blocks", "vecs")):
            held.pointers[i] = base + getattr(_ListedArguments, name).offset
    n = len(src_ids)
    held.src, held.dst, held.blocks, held.vecs = src, dst, n, vecs
    held.src_ids[:n], held.dst_ids[:n] = src_ids, dst_ids
    return ctypes.addressof(held) + _ListedArguments.pointers.offset


def copy_listed(src: torch.Tensor, src_ids: tuple[int, ...], dst: torch.Tensor, dst_ids: tuple[int, ...],
                stream: torch.cuda.Stream | None = None) -> None:
    """``copy_blocks`` of a few blocks named by Python ints (checked already), one by one on
    ``stream`` (None: the caller's current one): on a GPU one ``cudaMemcpyAsync`` each (torch's
    indexing and ``copy_`` cost ~40 µs a block on the hosts measured, a one-block transfer's
    largest step), launched on the stream's handle without making it torch's current one."""
    planned = route(src, dst)
    if planned is not None:
        copy_routed(planned, src_ids, dst_ids, current_stream(src.device) if stream is None else stream.cuda_stream)
        return
    bits = layout_for(src.dtype).int_dtype
    source, destination = src.view(bits), dst.view(bits)
    with on_stream(stream):
        for s, d in zip(src_ids, dst_ids):
            destination[d].copy_(source[s], non_blocking=True)
        _joined(src, dst)


def _joined(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Work queued on ``dst``'s GPU (the torch path into another GPU's memory) is waited for by
    ``src``'s current stream, the one the caller synchronizes."""
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        torch.cuda.current_stream(src.device).wait_stream(torch.cuda.current_stream(dst.device))


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def _kernel_fits(src: torch.Tensor, dst: torch.Tensor) -> bool:
    if not (src.is_cuda and dst.is_cuda and src.is_contiguous() and dst.is_contiguous() and src.dim() and dst.dim()):
        return False
    block_bytes = _block_bytes(src)
    if block_bytes == 0 or block_bytes % VEC or _block_bytes(dst) != block_bytes:
        return False
    if src.data_ptr() % VEC or dst.data_ptr() % VEC:
        return False
    return _module(src.device.index) is not None and (
        src.device == dst.device or _peer_access(src.device.index, dst.device.index))


def _launch(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, count: int = 1,
            src_stride: int = 0, dst_stride: int = 0, on: torch.device | None = None) -> None:
    """One ``cuLaunchKernel`` on torch's current stream of ``on`` (default ``src``'s GPU),
    arguments as 8-byte values (the codec kernels' launch: no per-call stream or argument objects)."""
    n = src_ids.numel() * count
    if n == 0:
        return
    device = on or src.device
    index = device.index
    vecs = _block_bytes(src) // VEC
    ids = src_ids.to(device), dst_ids.to(device)
    if vecs <= PAGE_VECS and n >= PAGE_MIN_BLOCKS:
        function, grid, threads = _module(index).pages, (1, min(n, 65535)), PAGE_THREADS
    else:
        function, grid, threads = _module(index).blocks, _block_grid(vecs, n), THREADS
    in_context(index, optional_cupy().cuda.driver.launchKernel, function, *grid, 1, threads, 1, 1,
                0, current_stream(device),
                kernel_parameters((src.data_ptr(), dst.data_ptr(), ids[0].data_ptr(), ids[1].data_ptr(), n, vecs, count,
                             src_stride, dst_stride)), 0)


def _block_grid(vecs: int, blocks: int) -> tuple[int, int]:
    """A block-per-row launch's grid: up to 64 CTAs of ``THREADS`` across a block, a row per block."""
    return max(1, min(-(-vecs // THREADS), 64)), min(blocks, 65535)


def _block_bytes(t: torch.Tensor) -> int:
    return t.numel() // t.shape[0] * t.element_size() if t.shape[0] else 0


@dataclass(frozen=True)
class _Kernels:
    owners: tuple  # CuPy's RawModule and RawKernels, which keep the functions loaded
    blocks: int  # CUfunction of copy_blocks
    pages: int  # CUfunction of copy_pages


@functools.cache
def _module(device_index: int) -> _Kernels | None:
    """The compiled kernels for a GPU, or None without CuPy (the reference path then)."""
    try:
        import cupy

        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=_SOURCE)
            blocks, pages = module.get_function("copy_blocks"), module.get_function("copy_pages")
            return _Kernels((module, blocks, pages), blocks.kernel.ptr, pages.kernel.ptr)
    except Exception:  # noqa: BLE001 (no CuPy, no compiler: the torch path serves)
        return None


@functools.cache
def _by_value(device_index: int) -> int | None:
    """``copy_listed_blocks`` compiled for a GPU (apart from the other kernels: its by-value
    arguments need a newer compiler), or None where it cannot be."""
    try:
        import cupy

        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=_LISTED_SOURCE, options=("-DLISTED_MAX=%d" % LISTED_MAX,))
            function = module.get_function("copy_listed_blocks")
            _BY_VALUE_OWNERS.append((module, function))
            return function.kernel.ptr
    except Exception:  # noqa: BLE001 (no CuPy, no compiler, or one without __grid_constant__)
        return None


_BY_VALUE_OWNERS: list = []  # CuPy's RawModules and RawKernels, which keep the functions loaded


@functools.cache
def _peer_access(here: int, there: int) -> bool:
    """Kernels on GPU ``here`` may write GPU ``there``'s memory (enabled once)."""
    import cupy

    if not cupy.cuda.runtime.deviceCanAccessPeer(here, there):
        return False
    with cupy.cuda.Device(here):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(there)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            if "PeerAccessAlreadyEnabled" not in str(exc):
                return False
    return True
