"""Exporting a worker's memory to its sidecar without a copy: CUDA IPC handles (same GPU host)."""

from __future__ import annotations

import base64


def cuda_ipc_handle(tensor) -> dict:
    """What a ``cuda_ipc`` region needs to map ``tensor`` in another process on the same GPU:
    the IPC handle of the allocation holding it and the tensor's offset into it (``ipc.export``)."""
    from kvferry.engine import ipc

    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("cuda_ipc needs a contiguous CUDA tensor")
    handle, offset, _ = ipc.export(tensor)
    return {"ipc_handle": base64.b64encode(handle).decode(), "offset": offset, "device": tensor.device.index}
