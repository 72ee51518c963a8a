"""Byte regions the transport reads from and writes into: host memory (anything with the buffer
protocol, or a CPU torch tensor) or CUDA memory (a CUDA torch tensor)."""

from __future__ import annotations

from typing import Any


class Buffer:
    """A flat byte view of a caller's buffer; ``region`` gives backend-ready slices of it."""

    def __init__(self, obj: Any, *, writable: bool = False):
        self.obj = obj
        self.is_device = bool(getattr(obj, "is_cuda", False))
        if self.is_device or _is_torch(obj):
            if not obj.is_contiguous():
                raise ValueError("tensor buffers must be contiguous")
            self._flat = obj.reshape(-1).view(_torch().uint8)
            self.nbytes = self._flat.numel()
            if not self.is_device:
                self._flat = memoryview(self._flat.numpy())
        else:
            view = memoryview(obj)
            if writable and view.readonly:
                raise ValueError("receive buffer is read-only")
            self._flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            self.nbytes = self._flat.nbytes

    def region(self, start: int, stop: int) -> Any:
        """Bytes [start, stop): a memoryview on the host, a uint8 tensor slice on the device."""
        return self._flat[start:stop]


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "is_contiguous")


def _torch():
    import torch

    return torch
