"""Small device-to-host reads (a frame header, a length, a verdict) through a pinned buffer kept
per thread: a read into pageable memory, as ``Tensor.item()`` does, costs tens of microseconds
more, and these reads sit between the GPU's bursts of work."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Generic, TypeVar

import numpy as np
import torch

_local = threading.local()
T = TypeVar("T")
U = TypeVar("U")


class Pending(Generic[T]):
    """GPU work launched on a stream, and what the host learns from it once that has run (a
    frame's length, a verdict). ``ready`` asks without waiting, so an event loop can await the
    GPU without blocking; ``result`` waits if need be, then reads."""

    __slots__ = ("_event", "_finish")

    def __init__(self, finish: Callable[[], T], event: torch.cuda.Event | None = None):
        self._finish = finish
        self._event = event

    @classmethod
    def done(cls, value: T) -> Pending[T]:
        """Work already finished (a host path, or one that had to wait anyway)."""
        return cls(lambda: value)

    @classmethod
    def after(cls, value: T, device: torch.device) -> Pending[T]:
        """``value`` once ``device``'s current stream has run what was launched on it so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(lambda: value, event)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> T:
        if self._event is not None:
            self._event.synchronize()
        return self._finish()

    def then(self, step: Callable[[T], U]) -> Pending[U]:
        """The same wait, followed by ``step`` of this result on the host."""
        return Pending(lambda: step(self._finish()), self._event)


def _pinned(nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
    held = getattr(_local, "held", None)
    if held is None or held[0].numel() < nbytes:
        buf = torch.empty(max(nbytes, 256), dtype=torch.uint8, pin_memory=True)
        held = _local.held = (buf, buf.numpy())
    return held


@functools.cache
def optional_cupy():
    """CuPy, or None where it is missing or finds no CUDA runtime. The GPU codec launches through
    it, and these reads use its runtime binding: two calls instead of torch's dispatch per step."""
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy that finds no CUDA runtime
        return None
    return cupy


def current_stream(device: torch.device) -> int:
    """The raw handle of torch's current stream on ``device`` (what Triton's launchers read:
    ``torch.cuda.current_stream`` builds a Python object per call)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)``, or nothing for None: torch's context costs a device look-up
    even for None (~10 µs a call on a host without CUDA), which a one-block write paid twice."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def read_to_host(t: torch.Tensor, nbytes: int, stream: int, offset: int = 0) -> np.ndarray:
    """``nbytes`` bytes from byte ``offset`` of the contiguous CUDA tensor ``t``, once ``stream``
    (a raw handle, torch's current stream for ``t``'s device) has produced them.

    The array is a copy: the pinned buffer is reused by this thread's next read.
    """
    buf, array = _pinned(nbytes)
    cupy = optional_cupy()
    if cupy is not None:
        runtime = cupy.cuda.runtime
        device = t.device.index
        if runtime.getDevice() != device:
            with torch.cuda.device(device):
                return read_to_host(t, nbytes, stream, offset)
        runtime.memcpyAsync(buf.data_ptr(), t.data_ptr() + offset, nbytes, runtime.memcpyDeviceToHost, stream)
        runtime.streamSynchronize(stream)
    else:
        buf[:nbytes].copy_(t.reshape(-1).view(torch.uint8)[offset:offset + nbytes], non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
    return array[:nbytes].copy()


def start_read(t: torch.Tensor, nbytes: int, offset: int = 0) -> Pending[np.ndarray]:
    """``read_to_host`` on torch's current stream, without waiting. The pinned copy is torch's,
    so its allocator keeps the memory until the copy has run even if the result is never read."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(t.reshape(-1).view(torch.uint8)[offset:offset + nbytes], non_blocking=True)
    return Pending.after(host, t.device).then(lambda read: read.numpy().copy())
