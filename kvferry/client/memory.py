"""Exporting a worker's memory to its sidecar without a copy: CUDA IPC handles (same GPU host)."""

from __future__ import annotations

import base64


def cuda_ipc_handle(tensor) -> dict:
    """What a ``cuda_ipc`` region needs to map ``tensor`` in another process on the same GPU:
    the IPC handle of the allocation holding it (CUDA hands out handles per allocation, so the
    base is looked up with cuMemGetAddressRange) and the tensor's offset into it."""
    import ctypes

    import cupy

    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("cuda_ipc needs a contiguous CUDA tensor")
    pointer = tensor.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                                  ctypes.c_uint64(pointer))
    if status != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {status}")
    with cupy.cuda.Device(tensor.device.index):
        handle = cupy.cuda.runtime.ipcGetMemHandle(base.value)
    return {"ipc_handle": base64.b64encode(bytes(handle)).decode(), "offset": pointer - base.value,
            "device": tensor.device.index}
