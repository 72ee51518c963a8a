"""Payload checksums. Host payloads carry the CRC32C of their bytes. Device payloads, which UCX
moves GPU to GPU without touching the host, carry a *segmented* CRC32C computed on the GPU: the
CRC32C of the little-endian CRC32Cs of their 4 KiB segments (the last one may be shorter), so
one GPU thread checksums each segment. ``segmented_crc`` is its CPU reference: the same value
from the same bytes, whichever side computes it.
"""

from __future__ import annotations

import functools
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
    n = payload.numel()
    if n == 0:
        return google_crc32c.value(b"")
    try:
        import cupy
    except ImportError:  # correct, if slow: the bytes go to the host once
        return segmented_crc(payload.cpu().numpy())
    import torch

    segments = -(-n // SEGMENT_BYTES)
    device = payload.device.index if payload.device.index is not None else torch.cuda.current_device()
    # On torch's current stream (not CuPy's legacy default, which would wait for every stream).
    stream = _cupy_stream(cupy, torch.cuda.current_stream(device), device)
    with cupy.cuda.Device(device), stream:
        data = cupy.asarray(payload)  # no copy: CUDA array interface
        out = cupy.empty(segments, dtype=cupy.uint32)
        threads = 128
        _kernel(device)((-(-segments // threads),), (threads,), (data, np.uint64(n), out, _table_on_device(device)))
        return google_crc32c.value(out.get(stream=stream).astype("<u4").tobytes())


def _cupy_stream(cupy: Any, stream: Any, device: int) -> Any:
    """A torch stream as CuPy's (``Stream.from_external`` where this CuPy has it)."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device)


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


@functools.lru_cache(maxsize=None)
def _table_on_device(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(_table())


@functools.lru_cache(maxsize=None)
def _kernel(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawKernel(_SOURCE, "segment_crc32c")


# One thread per segment, the table in shared memory; aligned words are taken four bytes at a time.
_SOURCE = r"""
extern "C" __global__ void segment_crc32c(const unsigned char* data, unsigned long long n,
                                          unsigned int* out, const unsigned int* table_global) {
    __shared__ unsigned int table[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = table_global[i];
    __syncthreads();
    unsigned long long segment = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long start = segment * 4096ULL;
    if (start >= n) return;
    unsigned long long end = start + 4096ULL < n ? start + 4096ULL : n;
    unsigned int crc = 0xFFFFFFFFu;
    unsigned long long i = start;
    if ((((unsigned long long)(data + i)) & 3ULL) == 0) {
        for (; i + 4 <= end; i += 4) {
            crc ^= *(const unsigned int*)(data + i);
            crc = table[crc & 0xFF] ^ (crc >> 8);
            crc = table[crc & 0xFF] ^ (crc >> 8);
            crc = table[crc & 0xFF] ^ (crc >> 8);
            crc = table[crc & 0xFF] ^ (crc >> 8);
        }
    }
    for (; i < end; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
    out[segment] = crc ^ 0xFFFFFFFFu;
}
"""
