"""Payload checksums. Host payloads carry the CRC32C of their bytes. Device payloads, which UCX
moves GPU to GPU without touching the host, carry a *segmented* CRC32C computed on the GPU: the
CRC32C of the little-endian CRC32Cs of their 4 KiB segments (the last one may be shorter), so
one GPU thread checksums each segment. ``segmented_crc`` is its CPU reference: the same value
from the same bytes, whichever side computes it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np

SEGMENT_BYTES = 4096


def crc(data: Any) -> int:
    """CRC32C of host bytes (google-crc32c takes only ``bytes``: others are copied, ~7 GB/s)."""
    return google_crc32c.value(data if isinstance(data, bytes) else bytes(data))


def segmented_crc(data: Any) -> int:
    """The segmented CRC32C of host bytes (the reference of ``device_segmented_crc``)."""
    view = memoryview(data).cast("B")
    crcs = np.array([google_crc32c.value(bytes(view[i:i + SEGMENT_BYTES]))
                     for i in range(0, len(view), SEGMENT_BYTES)], dtype="<u4")
    return google_crc32c.value(crcs.tobytes())


def device_segmented_crc(payload: Any) -> int:
    """The segmented CRC32C of a CUDA uint8 tensor, computed on its device (CuPy kernel) on the
    current stream; falls back to the host reference without CuPy."""
    return start_device_segmented_crc(payload)()


def start_device_segmented_crc(payload: Any) -> Callable[[], int]:
    """Launch ``device_segmented_crc`` on the current stream without waiting: the returned
    function gives the value once the stream has run (waiting for that if need be) and has a
    ``ready()`` that asks without waiting. A consumer that synchronizes the stream anyway (a
    decode) pays no wait of its own for the check."""
    n = payload.numel()
    if n == 0:
        return _Known(google_crc32c.value(b""))
    try:
        import cupy
    except ImportError:  # correct, if slow: the bytes go to the host once
        return _Known(segmented_crc(payload.cpu().numpy()))
    import torch

    if not payload.is_contiguous():
        payload = payload.contiguous()
    segments = -(-n // SEGMENT_BYTES)
    last = n - (segments - 1) * SEGMENT_BYTES
    device = payload.device.index if payload.device.index is not None else torch.cuda.current_device()
    # On torch's current stream (not CuPy's legacy default, which would wait for every stream).
    # This sits on every device message's path, at both ends: raw pointers, a cached stream and
    # one pinned read keep its host side to a few tens of microseconds.
    handle = torch._C._cuda_getCurrentRawStream(device)
    out = torch.empty(segments, dtype=torch.int32, device=payload.device)  # stream-ordered: freed safely
    with cupy.cuda.Device(device), _external_stream(cupy, handle, device):
        _kernel(device)((min(-(-segments // _WARPS), _MAX_BLOCKS),), (32 * _WARPS,),
                        (np.uint64(payload.data_ptr()), np.uint64(n), np.uint64(segments), np.uint64(out.data_ptr()),
                         _tables_on_device(device), np.uint32(_zeros_crc(SEGMENT_BYTES)), np.uint32(_zeros_crc(last))))
    # Copied by torch, whose pinned allocator then keeps ``host`` until the copy has run, even
    # if the value is never asked for (a send that failed first).
    host = torch.empty(segments, dtype=torch.int32, pin_memory=True)
    host.copy_(out, non_blocking=True)
    # An event, not the stream: work launched on the stream later must not hold up the value.
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(payload.device))  # ``handle``
    return _DeviceCrc(event, host)


class _Known:
    """A CRC computed already."""

    def __init__(self, value: int):
        self._value = value

    def ready(self) -> bool:
        return True

    def __call__(self) -> int:
        return self._value


class _DeviceCrc:
    """A segmented CRC the GPU is computing: the segments' CRCs land in ``host``."""

    def __init__(self, event: Any, host: Any):
        self._event = event
        self._host = host

    def ready(self) -> bool:
        return self._event.query()

    def __call__(self) -> int:
        self._event.synchronize()
        return google_crc32c.value(self._host.numpy().tobytes())  # x86 and CUDA: little-endian already


@functools.lru_cache(maxsize=64)
def _external_stream(cupy: Any, handle: int, device: int) -> Any:
    """torch's stream ``handle`` as CuPy's (kernels launch on CuPy's current stream). CuPy
    deprecates ``ExternalStream`` for objects with ``__cuda_stream__``; a raw handle has none."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device)


def verify(region: Any, expected: int, segmented: bool) -> bool:
    """Whether a received payload (host memoryview or CUDA tensor) matches its header's check."""
    if getattr(region, "is_cuda", False):
        if segmented:
            return device_segmented_crc(region) == expected
        return crc(region.cpu().numpy()) == expected  # a host sender's payload received into the GPU
    return (segmented_crc(region) if segmented else crc(region)) == expected


@functools.lru_cache(maxsize=1)
def _table() -> np.ndarray:
    """The reflected CRC32C (Castagnoli, 0x82F63B78) byte table."""
    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        value = byte
        for _ in range(8):
            value = (value >> 1) ^ 0x82F63B78 if value & 1 else value >> 1
        table[byte] = value
    return table


# The kernel splits a segment into 32 pieces of 128 bytes, one per lane of a warp, and joins their
# CRCs in a tree of five steps. CRC32C without its initial and final inversion (``R``) is linear:
# R(A + B) = S_|B|(R(A)) ^ R(B), where S_k is the CRC of k zero bytes from a given register (a
# 32 x 32 bit matrix, applied as four byte tables). A piece's CRC takes eight bytes at a time
# (slicing-by-8). With the inversions, CRC(M) = R(M) ^ CRC(zeros of len(M)), and a short segment
# is read as zeros before its bytes, which R ignores.
_PIECE_BYTES = 128
_LEVELS = 5  # 32 pieces
_WARPS = 8  # segments per CTA at a time
_MAX_BLOCKS = 1024  # CTAs loop over the segments: each loads the tables once


@functools.lru_cache(maxsize=None)
def _zeros_crc(n: int) -> int:
    return google_crc32c.value(bytes(n))


def _byte_tables(images: np.ndarray) -> np.ndarray:
    """Four 256-entry tables applying the linear map whose images of the 32 bits are ``images``."""
    bits = (np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    return np.stack([np.bitwise_xor.reduce(np.where(bits == 1, images[8 * k:8 * k + 8], np.uint32(0)), axis=1)
                     for k in range(4)]).astype(np.uint32)


@functools.lru_cache(maxsize=1)
def tables() -> np.ndarray:
    """The kernel's tables, flat: slicing-by-8 (8 x 256), then the zero-byte shifts by 128 << l
    bytes for each tree level l (5 x 4 x 256)."""
    base = _table()
    slicing = [base]
    for _ in range(7):
        slicing.append((slicing[-1] >> 8) ^ base[slicing[-1] & 0xFF])
    shifts = []
    images = np.uint32(1) << np.arange(32, dtype=np.uint32)
    done = 0
    for level in range(_LEVELS):
        for _ in range((_PIECE_BYTES << level) - done):
            images = base[images & 0xFF] ^ (images >> 8)
        done = _PIECE_BYTES << level
        shifts.append(_byte_tables(images))
    return np.concatenate([np.concatenate(slicing), np.concatenate(shifts).reshape(-1)]).astype(np.uint32)


@functools.lru_cache(maxsize=None)
def _tables_on_device(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(tables())


@functools.lru_cache(maxsize=None)
def _kernel(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawKernel(_SOURCE, "segment_crc32c")


# A warp per 4 KiB segment, 128 bytes per lane (eight 16-byte loads where the segment is whole and
# aligned, else byte by byte), the tables in shared memory.
_SOURCE = f"#define LEVELS {_LEVELS}\n" + r"""
#define TABLE_WORDS ((8 + 4 * LEVELS) * 256)
__device__ __forceinline__ unsigned int shift(const unsigned int* t, unsigned int c) {
    return t[c & 0xFF] ^ t[256 + ((c >> 8) & 0xFF)] ^ t[512 + ((c >> 16) & 0xFF)] ^ t[768 + (c >> 24)];
}
__device__ __forceinline__ unsigned int step8(const unsigned int* t, unsigned int c, unsigned int one,
                                              unsigned int two) {
    c ^= one;
    return t[7 * 256 + (c & 0xFF)] ^ t[6 * 256 + ((c >> 8) & 0xFF)] ^ t[5 * 256 + ((c >> 16) & 0xFF)]
         ^ t[4 * 256 + (c >> 24)] ^ t[3 * 256 + (two & 0xFF)] ^ t[2 * 256 + ((two >> 8) & 0xFF)]
         ^ t[256 + ((two >> 16) & 0xFF)] ^ t[two >> 24];
}
extern "C" __global__ void segment_crc32c(const unsigned char* data, unsigned long long n,
                                          unsigned long long segments, unsigned int* out,
                                          const unsigned int* tables, unsigned int zeros_full,
                                          unsigned int zeros_last) {
    __shared__ unsigned int t[TABLE_WORDS];
    for (int i = threadIdx.x; i < TABLE_WORDS; i += blockDim.x) t[i] = tables[i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x >> 5);
    for (unsigned long long seg = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         seg < segments; seg += warps) {
        const unsigned long long start = seg * 4096ULL;
        const unsigned long long len = n - start < 4096ULL ? n - start : 4096ULL;
        unsigned int c = 0;
        if (len == 4096ULL && (((unsigned long long)(data + start)) & 15ULL) == 0) {
            const uint4* p = (const uint4*)(data + start + lane * 128);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const uint4 v = __ldg(p + k);
                c = step8(t, c, v.x, v.y);
                c = step8(t, c, v.z, v.w);
            }
        } else {  // read as 4096 bytes: zeros, then the segment's
            const long long pad = 4096LL - (long long)len;
            for (int i = 0; i < 128; ++i) {
                const long long at = (long long)lane * 128 + i - pad;
                const unsigned int b = at >= 0 ? data[start + at] : 0u;
                c = t[(c ^ b) & 0xFF] ^ (c >> 8);
            }
        }
#pragma unroll
        for (int level = 0; level < LEVELS; ++level) {
            const unsigned int right = __shfl_down_sync(0xFFFFFFFFu, c, 1 << level);
            if ((lane & ((2 << level) - 1)) == 0) c = shift(t + 2048 + level * 1024, c) ^ right;
        }
        if (lane == 0) out[seg] = c ^ (len == 4096ULL ? zeros_full : zeros_last);
    }
}
"""
