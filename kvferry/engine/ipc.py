"""Same-host writes: NIXL's model on one node. A receiver whose destination regions are on a
GPU lends their CUDA IPC handles, in its ACCEPT, to the (authenticated) sender on the same host;
the sender writes the blocks straight into that memory with one gather-scatter on its GPU and
says WRITTEN. No staging buffer, no message per chunk, no codec: on one host the copy engine
outruns any codec, so this path moves blocks as they are. Regions in host shared memory (kind
``shm``) are lent the same way, by name. The lease stands for later transfers (``leases.py``).

Handles are per allocation (``cuMemGetAddressRange`` finds its base), opened once and cached by
the sender, and meaningful only on this host: a peer elsewhere never gets one (``HOST_ID``).

A large write is announced while it runs (``WriteEvents``): the sender records an interprocess
CUDA event behind it and sends the event's handle; the receiver opens it and says DONE once it
is reached.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import socket
import threading
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.codec import blockcopy

from . import peer

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# CUDA IPC mappings kept beyond those under a lease or a write (which stay until let go), least
# recently used unmapped first: a lease lost before its first write is still written once.
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
    with cupy.cuda.Device(tensor.device.index):  # the driver looks the pointer up in the current context
        # A thread that never touched CUDA has no current context, and CuPy switches devices only
        # when the index differs: bind the device's primary context to this thread first (an
        # engine may export from a worker thread, e.g. a connector's lease thread).
        cupy.cuda.runtime.setDevice(tensor.device.index)
        cupy.cuda.runtime.free(0)
        base, _ = address_range(pointer)
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    return handle, pointer - base, device_uuid(tensor.device.index)


class Mapper:
    """The sender's opened targets (opening a handle costs milliseconds; a transfer reuses them),
    each checked before any write: it lies inside the memory the receiver lent (an offset or block
    count that reaches past it is refused, not written), and it is none of the sender's own.

    A GPU target is opened where the writing kernel runs, in the context of the source's GPU
    (``tensor``'s ``device``): on another GPU of the host its memory is reached over NVLink or PCIe
    peer-to-peer (``cudaIpcMemLazyEnablePeerAccess``), and the view is a tensor of the source's
    device. Where the GPUs cannot reach each other it is opened on its own GPU, and the copy crosses
    through the driver (``blockcopy``'s torch path)."""

    def __init__(self, shm_prefix: str = "kvferry-", own: Callable[[], Iterable[Any]] = tuple,
                 own_version: Callable[[], int] | None = None, in_use: Callable[[], Collection[bytes]] = frozenset,
                 opened: Callable[[], None] = lambda: None) -> None:
        """``shm_prefix``: a shared-memory target must be named so; ``own``: the sender's regions
        holding memory (what no target may alias); ``own_version``: a number that changes whenever
        that memory does (the views are then checked again), else they are compared at every use;
        ``in_use``: the handles of memory a lease names or a write runs into, never unmapped to make
        room; ``opened``: called for each memory opened (a handle or a segment)."""
        self._shm_prefix = shm_prefix
        self._own = own
        self._own_version = own_version
        self._in_use = in_use
        self._on_open = opened
        self._seen_version: int | None = None
        self._open: OrderedDict[tuple[bytes, int], _Opened] = OrderedDict()  # (handle, writing GPU) ->
        self._views: dict[tuple, torch.Tensor] = {}  # (handle, offset, shape, dtype, writing GPU) -> tensor
        # (view's key, id(source)) -> (the source, weakly; the view; blockcopy's route from one into the other)
        self._routes: dict[tuple, tuple[weakref.ref, torch.Tensor, blockcopy.Route | None]] = {}
        self._shm: dict[bytes, Any] = {}  # shared memory opened by name, while its views live
        self._mine: list[weakref.ref] = []  # without ``own_version``: the regions the views were checked against
        self._lock = threading.RLock()  # writes run on the event loop and in worker threads at once

    def mapped(self) -> int:
        """Memories of receivers mapped here now: CUDA IPC handles (once per writing GPU) and
        shared-memory segments. Read without the lock (a scrape on the loop must not wait for a
        worker thread opening a handle): each count is one step under the GIL."""
        return len(self._open) + len(self._shm)

    def tensor(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | None = None) -> torch.Tensor:
        """The receiver's region as a tensor here, for a write from ``device`` (the source's).

        Raises:
            RuntimeError: its GPU is not visible here, the handle does not open, or the region
                (``target.offset`` plus ``shape``'s bytes) is not inside the memory it names, or is
                the sender's own.
        """
        with self._lock:
            return self._tensor(target, shape, dtype, device)

    def _tensor(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | None) -> torch.Tensor:
        self._check_own()
        here = device.index if device is not None and device.type == "cuda" else None
        key = (target.handle, target.offset, shape, dtype, here)
        if target.device_uuid == peer.HOST_MEMORY:
            return self._host(target, shape, dtype, key)
        view = self._views.get(key)
        if view is not None:
            self._open.move_to_end((target.handle, here))
            return view
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        there = _local_index(target.device_uuid)
        self._check_not_own(target, nbytes)
        opened = self._opened(target.handle, there, there if here is None else here)
        if target.offset + nbytes > opened.size:
            raise RuntimeError(f"the lent region ({nbytes} bytes at offset {target.offset}) reaches past the "
                               f"{opened.size}-byte allocation its handle names")
        pointer = opened.base + target.offset
        for region in self._own():
            t = region.tensor
            if t.is_cuda and t.numel() and pointer < t.data_ptr() + t.numel() * t.element_size() \
                    and t.data_ptr() < pointer + nbytes:
                raise RuntimeError(f"the lent region is the sender's own region {region.name!r}")
        view = self._views[key] = _as_tensor(pointer, nbytes, opened.device).view(dtype).view(shape)
        return view

    def route(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype,
              src: torch.Tensor) -> tuple[torch.Tensor, blockcopy.Route | None]:
        """``tensor`` for a write from ``src`` (a region's memory, fixed for its life), with
        ``blockcopy``'s route from ``src`` into it (None: torch's path), both worked out once
        while the view lives.

        Raises:
            RuntimeError: as ``tensor``.
        """
        with self._lock:
            return self._route(target, shape, dtype, src)

    def _route(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype,
               src: torch.Tensor) -> tuple[torch.Tensor, blockcopy.Route | None]:
        if target.device_uuid == peer.HOST_MEMORY:  # its size is checked at every write; the driver copies none
            return self._tensor(target, shape, dtype, src.device), None
        self._check_own()
        here = src.device.index if src.is_cuda else None
        key = (target.handle, target.offset, shape, dtype, here, id(src))
        known = self._routes.get(key)
        if known is not None and known[0]() is src:
            self._open.move_to_end((target.handle, here))
            return known[1], known[2]
        view = self._tensor(target, shape, dtype, src.device)
        planned = blockcopy.route(src, view)
        self._routes[key] = (weakref.ref(src), view, planned)
        return view, planned

    def _check_own(self) -> None:
        """Every target is checked again once the sender's regions changed. They are remembered
        weakly: a region deleted is freed, not kept by this map until the next write."""
        if self._own_version is not None:
            version = self._own_version()
            if version != self._seen_version:
                self._seen_version = version
                self._views.clear()
                self._routes.clear()
            return
        mine = list(self._own())
        if len(mine) != len(self._mine) or any(a is not b() for a, b in zip(mine, self._mine)):
            self._views.clear()
            self._routes.clear()
            self._mine = [weakref.ref(region) for region in mine]

    def _opened(self, handle: bytes, there: int, here: int) -> _Opened:
        """``handle`` (memory on GPU ``there``) opened for kernels on GPU ``here``: in ``here``'s
        context where it reaches ``there`` peer-to-peer, else in ``there``'s."""
        import cupy

        key = (handle, here)
        opened = self._open.get(key)
        if opened is not None:
            self._open.move_to_end(key)
            return opened
        device = here if here == there or _can_reach(here, there) else there
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            try:
                base = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            except runtime.CUDARuntimeError as exc:
                raise RuntimeError(f"the receiver's CUDA IPC handle does not open on GPU {device}: {exc}") from None
            try:
                start, size = address_range(base)
            except RuntimeError:
                runtime.ipcCloseMemHandle(base)
                raise
        opened = self._open[key] = _Opened(start, size, device)
        self._on_open()
        if len(self._open) > _OPEN_LIMIT:
            self._make_room(key)
        return opened

    def _make_room(self, keep: tuple[bytes, int]) -> None:
        """Unmap the least recently used memories beyond ``_OPEN_LIMIT`` that no lease names and
        no write runs into (a write on another thread may be copying into one this moment, and an
        unmapped target faults the GPU; a leased one is let go with its lease, ``forget``)."""
        busy = self._in_use()
        spare = [k for k in self._open if k != keep and k[0] not in busy][:len(self._open) - _OPEN_LIMIT]
        for old, old_here in spare:
            stale = self._open.pop((old, old_here))
            self._views = {k: v for k, v in self._views.items() if (k[0], k[4]) != (old, old_here)}
            self._routes = {k: v for k, v in self._routes.items() if (k[0], k[4]) != (old, old_here)}
            self._close_ipc(stale)

    def _check_not_own(self, target: peer.Target, nbytes: int) -> None:
        """A handle the sender itself lends or was lent (its regions' memory), at overlapping
        bytes, is refused before it is opened."""
        for region in self._own():
            export = getattr(region, "ipc_export", None)
            if export is not None and export[0] == target.handle:
                mine = region.tensor.numel() * region.tensor.element_size()
                if target.offset < export[1] + mine and export[1] < target.offset + nbytes:
                    raise RuntimeError(f"the lent region is the sender's own region {region.name!r}")

    def _host(self, target: peer.Target, shape: tuple[int, ...], dtype: torch.dtype, key: tuple) -> torch.Tensor:
        """A receiver's shared-memory region, opened by its name: one named with ``shm_prefix``,
        not one of the sender's own segments and, checked before every write, the segment the
        receiver lent (a worker may give the name to a new segment after it was opened here) and
        large enough (another process may shrink it, and a write past its end would kill this
        one). The kept view is taken only once the size holds: a refusal's traceback must not hold
        a view, which would keep the mapping from closing until the garbage collector finds it."""
        import numpy as np

        name = target.handle.rstrip(b"\0").decode(errors="replace")
        shm = self._shm.get(target.handle)
        opened = shm is None
        if shm is None:
            if not name.startswith(self._shm_prefix) or "/" in name or "\0" in name:
                raise RuntimeError(f"the receiver's shared memory {name!r} is not named with {self._shm_prefix!r} "
                                   "(shm_prefix)")
            try:
                shm = open_segment(name)
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"cannot open the receiver's shared memory {name!r}: {exc}") from exc
            self._shm[target.handle] = shm
            self._on_open()
        try:
            stat = os.fstat(shm._fd)
        except OSError as exc:
            raise RuntimeError(f"cannot read the size of the receiver's shared memory {name!r}: {exc}") from exc
        if peer.segment_id(stat) != target.segment:
            self.forget(target.handle)  # the lock is re-entered: this runs under it
            if opened:
                raise RuntimeError(f"the receiver's shared memory {name!r} is not the segment it lent: the name "
                                   "now names another")
            return self._host(target, shape, dtype, key)  # opened before the name was given to a new segment
        size = stat.st_size
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if target.offset + nbytes > min(size, shm.size):
            raise RuntimeError(f"the receiver's shared memory {name!r} holds {min(size, shm.size)} bytes, "
                               f"the lent region needs {target.offset + nbytes}")
        view = self._views.get(key)
        if view is None:
            self._check_not_own_segment(name, shm)
            array = np.frombuffer(shm.buf, dtype=np.uint8, count=nbytes, offset=target.offset)
            view = self._views[key] = torch.from_numpy(array).view(dtype).view(shape)
        return view

    def _check_not_own_segment(self, name: str, shm: Any) -> None:
        lent = os.fstat(shm._fd)
        for region in self._own():
            if getattr(region, "kind", "") != "shm":
                continue
            mine = getattr(region, "_keepalive", None)
            same_file = False
            if mine is not None and getattr(mine, "_fd", -1) >= 0:
                try:
                    own = os.fstat(mine._fd)
                    same_file = (own.st_dev, own.st_ino) == (lent.st_dev, lent.st_ino)
                except OSError:
                    pass
            if same_file or region.shm_name.lstrip("/") == name.lstrip("/"):
                raise RuntimeError(f"the receiver's shared memory {name!r} is the sender's own region {region.name!r}")

    def forget(self, handle: bytes) -> None:
        """Let go of the memory ``handle`` names (no lease of it is held any more, and no write under
        one is under way): its views, its shared-memory mapping and descriptor, or its CUDA IPC
        mappings. A receiver's freed memory is then freed, not kept by this sidecar's mapping."""
        with self._lock:
            self._views = {k: v for k, v in self._views.items() if k[0] != handle}
            self._routes = {k: v for k, v in self._routes.items() if k[0] != handle}
            shm = self._shm.pop(handle, None)
            if shm is not None:
                close_segment(shm)
            for key in [key for key in self._open if key[0] == handle]:
                self._close_ipc(self._open.pop(key))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._views.clear()
        self._routes.clear()
        for shm in self._shm.values():
            close_segment(shm)
        self._shm.clear()
        for opened in self._open.values():
            self._close_ipc(opened)
        self._open.clear()

    @staticmethod
    def _close_ipc(opened: _Opened) -> None:
        import cupy

        with cupy.cuda.Device(opened.device):
            cupy.cuda.runtime.ipcCloseMemHandle(opened.base)


def open_segment(name: str) -> Any:
    """A worker's shared-memory segment opened by name, as a ``SharedMemory``, which this process
    never unlinks and never registers with the resource tracker (the worker owns the segment).
    The standard library's constructor unlinks the name when mapping it fails (a process at its
    descriptor limit, an ``mmap`` refused): that would delete a segment this process does not own.

    Raises:
        OSError: the name does not open or the segment does not map. ValueError: it is empty.
    """
    import mmap
    from multiprocessing import shared_memory

    import _posixshmem

    path = "/" + name  # as the standard library names it
    fd = _posixshmem.shm_open(path, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    shm = shared_memory.SharedMemory.__new__(shared_memory.SharedMemory)
    shm._name, shm._fd, shm._mmap, shm._size = path, fd, mapping, size
    shm._flags, shm._mode, shm._buf = os.O_RDWR, 0o600, memoryview(mapping)
    return shm


def close_segment(shm: Any) -> None:
    """Unmap a shared-memory segment (a ``SharedMemory``) and close its descriptor. A view of it may
    outlive its owner by a moment (a worker thread whose codec call has returned holds its arguments
    until it takes the next call): the mapping then goes with its last view, and nothing fails here
    or later in the segment's finalizer."""
    try:
        shm.close()
    except BufferError:
        shm._mmap = None  # what the views still hold keeps the mapping alive until they go
        if shm._fd >= 0:
            os.close(shm._fd)
            shm._fd = -1


@dataclass(frozen=True)
class WriteEnd:
    """An interprocess event recorded behind a same-host write: where the write ends."""

    event: torch.cuda.Event
    handle: bytes  # its CUDA IPC handle (``peer.EVENT_BYTES``)
    gpu: bytes  # the UUID of its GPU

    def ready(self) -> bool:
        """Whether the write is finished (``transport.until_ready``'s question).

        Raises:
            RuntimeError: the GPU work before the event failed.
        """
        return self.event.query()


def event_device(memory: torch.device) -> int | None:
    """The GPU whose context opens a peer's event for a write into ``memory``: the GPU the write
    lands on (``WriteEvents.open``); None for host memory, which no GPU event ends."""
    return memory.index if memory.type == "cuda" else None


class WriteEvents:
    """Both sides of a write announced while it runs. The sender's interprocess events, reused:
    each goes back once its own write is seen finished, and is recorded again only after
    ``RING - 1`` others, so a receiver still polling an old write is not kept waiting for a new
    one. The receiver's events opened from peers' handles (opening costs a driver call; a sender
    reuses few), each in the context of the GPU its write lands on, at most ``OPEN_LIMIT``, the
    least recently used closed first, and a peer's all once its connection is gone (an event its
    sender destroyed must not be queried)."""

    RING = 8
    OPEN_LIMIT = 64

    def __init__(self) -> None:
        self._free: dict[int, deque[WriteEnd]] = {}
        self._opened: OrderedDict[bytes, tuple[WriteEnd, Hashable]] = OrderedDict()
        self._refused: set[tuple[Hashable, bytes]] = set()  # (connection, GPU) whose events do not open here

    def record(self, stream: torch.cuda.Stream) -> WriteEnd:
        """An event recorded on ``stream`` now, behind the work launched on it. Every same-host
        write of a sidecar goes on its one encode stream, so an event recorded again is reached
        only after the write it ended before: a receiver still polling it waits longer, never less."""
        free = self._free.setdefault(stream.device.index, deque())
        if len(free) >= self.RING:
            end = free.popleft()
        else:
            event = torch.cuda.Event(interprocess=True)
            event.record(stream)
            return WriteEnd(event, bytes(event.ipc_handle()), device_uuid(stream.device.index))
        end.event.record(stream)
        return end

    def give(self, end: WriteEnd) -> None:
        """``end`` was reached (its write is finished): it may be recorded again."""
        self._free.setdefault(_local_index(end.gpu), deque()).append(end)

    def open(self, handle: bytes, gpu: bytes, device: int | None, owner: Hashable = None) -> WriteEnd | None:
        """A peer's event from GPU ``gpu``, to wait on here, kept for ``owner`` (its connection).
        It is opened in this process's context on ``device``, the GPU its write lands on: an
        interprocess event is queried from another GPU's context as from its own (measured on
        two H200s), so no context is made on the sender's GPU, which need not even be visible
        here. None where it cannot be (no CUDA or CuPy here, memory not on a GPU, the driver
        refuses the handle): the receiver then asks for WRITTEN."""
        kept = self._opened.get(handle)
        if kept is not None and kept[0].gpu == gpu and kept[1] == owner:
            self._opened.move_to_end(handle)
            return kept[0]
        if device is None or not available() or (owner, gpu) in self._refused:
            return None
        try:
            event = torch.cuda.Event.from_ipc_handle(device, handle)
        except RuntimeError:
            self._refused.add((owner, gpu))  # not tried again for this peer: each try is a driver call
            return None
        end = WriteEnd(event, handle, gpu)
        self._opened[handle] = (end, owner)
        self._opened.move_to_end(handle)
        while len(self._opened) > self.OPEN_LIMIT:
            self._opened.popitem(last=False)
        return end

    def forget(self, owner: Hashable) -> None:
        """``owner``'s connection is gone: the events opened for it are let go."""
        for handle in [h for h, (_, o) in self._opened.items() if o == owner]:
            del self._opened[handle]
        self._refused = {(o, gpu) for o, gpu in self._refused if o != owner}

    def close(self) -> None:
        self._free.clear()
        self._opened.clear()
        self._refused.clear()


@dataclass(frozen=True)
class _Opened:
    base: int  # the allocation's first byte, in the context of ``device``
    size: int  # its bytes (``cuMemGetAddressRange``): what a target may reach
    device: int  # the GPU whose context holds the mapping


def own_allocation(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` zeroed bytes of ``device`` in an allocation of their own (``cudaMalloc``, not
    torch's caching allocator), freed when the tensor is: lent over CUDA IPC, whose handle maps a
    whole allocation, they expose nothing else of this process.

    Raises:
        RuntimeError: the driver refused (out of memory).
    """
    import cupy

    with cupy.cuda.Device(device.index):
        try:
            memory = cupy.cuda.Memory(nbytes)
        except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.memory.OutOfMemoryError) as exc:
            raise RuntimeError(f"cudaMalloc of {nbytes} bytes: {exc}") from None
        cupy.cuda.runtime.memset(memory.ptr, 0, nbytes)
        cupy.cuda.Stream.null.synchronize()  # zeroed before any stream of this process uses it
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)  # the capsule keeps ``array`` and so the allocation alive


def address_range(pointer: int) -> tuple[int, int]:
    """(base, size) of the allocation holding ``pointer``, looked up in the current context.

    Raises:
        RuntimeError: the driver does not know the pointer there.
    """
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
    if status != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {status}")
    return base.value, size.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _can_reach(here: int, there: int) -> bool:
    """Kernels on GPU ``here`` can address GPU ``there``'s memory (NVLink or PCIe peer-to-peer)."""
    import cupy

    return bool(cupy.cuda.runtime.deviceCanAccessPeer(here, there))


def _as_tensor(pointer: int, nbytes: int, device: int) -> torch.Tensor:
    """Bytes at ``pointer`` (valid in GPU ``device``'s context) as a uint8 tensor of that device.
    Through DLPack, which names the device: torch's CUDA array interface would take the device the
    memory lives on (the receiver's GPU), and copy it to this one, writing a copy.

    Raises:
        RuntimeError: the view is not the memory asked for.
    """
    import cupy

    memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner=None, device_id=device)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    with cupy.cuda.Device(device):
        view = torch.from_dlpack(array)
    if view.data_ptr() != pointer or view.device != torch.device("cuda", device):
        raise RuntimeError(f"the lent memory mapped as {view.device}:{view.data_ptr():#x}, not "
                           f"cuda:{device}:{pointer:#x}")
    return view


@functools.cache
def _uuids() -> dict[bytes, int]:
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def _local_index(uuid_bytes: bytes) -> int:
    try:
        return _uuids()[uuid_bytes]
    except KeyError:
        raise RuntimeError(f"the receiver's GPU {uuid.UUID(bytes=uuid_bytes)} is not visible here") from None
