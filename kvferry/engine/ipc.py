"""Same-host writes: NIXL's model on one node. A receiver whose destination regions are on a
GPU lends their CUDA IPC handles, in its ACCEPT, to the (authenticated) sender on the same host;
the sender writes the blocks straight into that memory with one gather-scatter on its GPU and
says WRITTEN. No staging buffer, no message per chunk, no codec: on one host the copy engine
outruns any codec, so this path moves blocks as they are. Regions in host shared memory (kind
``shm``) are lent the same way, by name. The lease stands for later transfers (``leases.py``).

Handles are per allocation (``cuMemGetAddressRange`` finds its base), opened once and cached by
the sender, and meaningful only on this host: a peer elsewhere never gets one (``HOST_ID``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import socket
import uuid
from collections import OrderedDict

import torch

from . import peer

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_OPEN_LIMIT = 64


@functools.cache
def host_id() -> bytes:
    """16 bytes naming this host's boot and its ``/dev/shm``: two sidecars share it only on the
    same machine and seeing the same shared memory (containers of one pod; not two pods, whose
    ``/dev/shm`` mounts differ), where lending memory by name or CUDA IPC handle can work."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm")
        mount = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        mount = ""
    return hashlib.blake2b(f"{socket.gethostname()}:{boot}:{mount}".encode(), digest_size=16).digest()


@functools.cache
def available() -> bool:
    """A GPU and CuPy's runtime binding (the IPC calls) are here."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401  (a probe)
    except Exception:
        return False
    return True


@functools.cache
def device_uuid(index: int) -> bytes:
    return uuid.UUID(str(torch.cuda.get_device_properties(index).uuid)).bytes


def export(tensor: torch.Tensor) -> tuple[bytes, int, bytes]:
    """(IPC handle of the allocation holding ``tensor``, its offset in it, the GPU's UUID).

    Raises:
        RuntimeError: not a CUDA tensor, or the driver refuses.
    """
    import cupy

    if not tensor.is_cuda:
        raise RuntimeError("only CUDA memory can be lent over CUDA IPC")
    pointer = tensor.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with cupy.cuda.Device(tensor.device.index):  # the driver looks the pointer up in the current context
        status = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                                      ctypes.c_uint64(pointer))
        if status != 0:
            raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {status}")
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base.value))
    return handle, pointer - base.value, device_uuid(tensor.device.index)


class Mapper:
    """The sender's opened handles (opening costs milliseconds; a transfer reuses them)."""

    def __init__(self) -> None:
        self._open: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # handle -> (base pointer, device)
        self._views: dict[tuple, torch.Tensor] = {}  # (handle, offset, shape, dtype) -> tensor
        self._shm: dict[bytes, object] = {}  # shared memory opened by name, while its views live

    def tensor(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The receiver's region as a tensor here.

        Raises:
            RuntimeError: its GPU is not visible here, or the handle does not open.
        """
        key = (target.handle, target.offset, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            if target.device_uuid == peer.HOST_MEMORY:
                self._check_size(target, view.numel() * view.element_size())
            if target.handle in self._open:
                self._open.move_to_end(target.handle)
            return view
        if target.device_uuid == peer.HOST_MEMORY:
            view = self._views[key] = self._host(target, shape, dtype)
            return view
        import cupy

        device = _local_index(target.device_uuid)
        entry = self._open.get(target.handle)
        if entry is None:
            with cupy.cuda.Device(device):
                base = cupy.cuda.runtime.ipcOpenMemHandle(target.handle)
            entry = self._open[target.handle] = (base, device)
            while len(self._open) > _OPEN_LIMIT:
                handle, (old, old_device) = self._open.popitem(last=False)
                self._views = {k: v for k, v in self._views.items() if k[0] != handle}
                with cupy.cuda.Device(old_device):
                    cupy.cuda.runtime.ipcCloseMemHandle(old)
        else:
            self._open.move_to_end(target.handle)
        base, device = entry
        nbytes = 1
        for dim in shape:
            nbytes *= dim
        nbytes *= torch.empty((), dtype=dtype).element_size()
        memory = cupy.cuda.UnownedMemory(base + target.offset, nbytes, owner=None, device_id=device)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        view = self._views[key] = torch.as_tensor(array, device=f"cuda:{device}").view(dtype).view(shape)
        return view

    def _host(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receiver's shared-memory region, opened by its name."""
        from multiprocessing import resource_tracker, shared_memory

        import numpy as np

        name = target.handle.rstrip(b"\0").decode(errors="replace")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        shm = self._shm.get(target.handle)
        if shm is None:
            try:
                shm = shared_memory.SharedMemory(name=name, create=False)
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"cannot open the receiver's shared memory {name!r}: {exc}") from exc
            resource_tracker.unregister(shm._name, "shared_memory")  # the receiver's worker owns it
            self._shm[target.handle] = shm
        self._check_size(target, nbytes)
        array = np.frombuffer(shm.buf, dtype=np.uint8, count=nbytes, offset=target.offset)
        return torch.from_numpy(array).view(dtype).view(shape)

    def _check_size(self, target: peer.Target, nbytes: int) -> None:
        """The receiver's segment still holds the region, checked before each write into it: its
        worker may have truncated it, and a write past its end would end this process (SIGBUS).
        A truncation between this check and the copy still would (``regions.Region``).

        Raises:
            RuntimeError: it is shorter than that.
        """
        size = os.fstat(self._shm[target.handle]._fd).st_size
        if target.offset + nbytes > size:
            name = target.handle.rstrip(b"\0").decode(errors="replace")
            raise RuntimeError(f"the receiver's shared memory {name!r} holds {size} bytes, not {target.offset + nbytes}")

    def close(self) -> None:
        self._views.clear()
        for shm in self._shm.values():
            try:
                shm.close()
            except BufferError:
                pass  # a view is still referenced somewhere: the mapping goes with the process
        self._shm.clear()
        if not self._open:
            return
        import cupy

        for base, device in self._open.values():
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.ipcCloseMemHandle(base)
        self._open.clear()


@functools.cache
def _uuids() -> dict[bytes, int]:
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def _local_index(uuid_bytes: bytes) -> int:
    try:
        return _uuids()[uuid_bytes]
    except KeyError:
        raise RuntimeError(f"the receiver's GPU {uuid.UUID(bytes=uuid_bytes)} is not visible here") from None
