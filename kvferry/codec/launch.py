"""Kernel launches through the CUDA driver, shared by every codec's GPU path and the block copy:
a reused parameter block per thread, and the device's primary context made current once per
thread (``cuLaunchKernel`` takes no device argument)."""

from __future__ import annotations

import ctypes
import threading

from .staging import optional_cupy

_thread = threading.local()


def kernel_parameters(args: tuple[int, ...]) -> int:
    """Address of a ``void*[]`` whose entries point at ``args`` as 64-bit values. The block is
    this thread's, reused by its next launch: ``cuLaunchKernel`` copies the values before it
    returns."""
    blocks = getattr(_thread, "parameters", None)
    if blocks is None:
        blocks = _thread.parameters = {}
    held = blocks.get(len(args))
    if held is None:
        values = (ctypes.c_uint64 * len(args))()
        base = ctypes.addressof(values)
        pointers = (ctypes.c_void_p * len(args))(*(base + 8 * i for i in range(len(args))))
        held = blocks[len(args)] = (values, pointers, ctypes.addressof(pointers))
    held[0][:] = args
    return held[2]


def in_context(device_index: int, call, *args) -> None:
    """``call(*args)`` with ``device_index``'s primary context current on this thread."""
    cupy = optional_cupy()
    if cupy.cuda.runtime.getDevice() != device_index:
        with cupy.cuda.Device(device_index):
            call(*args)
        return
    if not getattr(_thread, "bound", False):  # once per thread: bind it to the runtime's context
        if not cupy.cuda.driver.ctxGetCurrent():
            cupy.cuda.runtime.free(0)
        _thread.bound = True
    call(*args)


def zero_async(device_index: int, pointer: int, nbytes: int, stream: int) -> None:
    """Zero ``nbytes`` at ``pointer`` on ``stream`` (a raw handle)."""
    in_context(device_index, optional_cupy().cuda.runtime.memsetAsync, pointer, 0, nbytes, stream)
