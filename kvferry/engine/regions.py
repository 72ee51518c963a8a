"""Registered KV memory: a tensor of ``num_blocks`` blocks of ``block_shape`` (block i is the
i-th slice along dim 0), owned by the sidecar, mapped from a worker's POSIX shared memory, or
opened from a worker's CUDA IPC handle. Registered once; transfers then name blocks by index."""

from __future__ import annotations

import asyncio
import base64
import functools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from kvferry.codec import BlockLayout, CodebookMismatch

from .blocks import Blocks
from .errors import BadRequest, Conflict, InsufficientStorage, InvalidBlocks, NotFound, PayloadTooLarge, RegionMemoryGone
from . import ipc
from .ipc import close_segment

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e5m2": torch.float8_e5m2,
          "float8_e4m3fn": torch.float8_e4m3fn}
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory by name
# Left free after an owned region is allocated: the process's own buffers and the codec's scratch.
HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True)
class RegionSpec:
    """What ``Engine.register_region`` needs: a name, a block layout, and where the memory is.

    ``axes`` optionally names the block's dimensions (e.g. ``("token", "head", "channel")``), so
    codecs that model KV by position know which axis is which.
    """

    name: str
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    kind: str = "owned"  # owned (allocated here), shm (a worker's POSIX segment), cuda_ipc
    shm_name: str | None = None
    ipc_handle: str | None = None
    device: int | None = None
    offset: int = 0
    axes: tuple[str, ...] | None = None


@dataclass
class Region:
    """A registered region. Its memory is ``tensor``; for ``kind=shm`` each use of it first
    checks (``os.fstat`` of the segment's descriptor, kept open) that the segment still holds
    the layout: a worker that truncates its segment would otherwise end this process with
    SIGBUS at the first touch of a block past the new end. A shrunken segment fails the request
    or transfer that asked (``RegionMemoryGone``) and the sidecar goes on serving.

    The race that remains: a segment truncated between the check and the access (a codec call
    in a thread, a copy) still raises SIGBUS. Only the worker that owns the segment can cause
    it, by shrinking memory it registered while a transfer uses it.
    """

    name: str
    kind: str
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    _tensor: torch.Tensor
    busy: set[str] = field(default_factory=set)  # ids of transfers reading or writing it
    axes: tuple[str, ...] | None = None
    ipc_export: tuple[bytes, int] | None = None  # cuda_ipc: the worker's (handle, offset), to lend on
    deleting: int = 0  # deletes under way or waiting their turn: lent to no sender, taking no transfer
    deletes: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one delete at a time
    # Why the region may still be written by a sender that did not confirm a revocation: it is
    # lent to nobody, takes no transfers, and is deleted only when asked with ``force``.
    quarantined: str | None = None
    shm_name: str = ""  # shm: the segment's name (what a same-host sender is lent)
    learned: dict[str, tuple[Any, float, bool, int]] = field(default_factory=dict)  # codec -> (codebook, when, settled, blocks)
    _keepalive: Any = None  # the shared-memory mapping or IPC handle the tensor views
    _segment_fd: int = -1  # shm: the segment's descriptor, whose size is checked before each use
    view_of: str | None = None  # a view: another name over the memory of region ``view_of``

    @property
    def closing(self) -> bool:
        """Lent to no sender and taking no transfer into it: a delete is under way, or it is quarantined."""
        return self.deleting > 0 or self.quarantined is not None

    @property
    def tensor(self) -> torch.Tensor:
        """The region's memory (block i is ``tensor[i]``).

        Raises:
            RegionMemoryGone: a shm segment no longer holds the layout.
        """
        if self._segment_fd >= 0:
            self.check_memory()
        return self._tensor

    def check_memory(self) -> None:
        """Raises: RegionMemoryGone (a shm segment shorter than the layout needs)."""
        if self._segment_fd < 0:
            return
        needed = self._tensor.numel() * self._tensor.element_size()
        try:
            size = os.fstat(self._segment_fd).st_size
        except OSError as exc:
            raise RegionMemoryGone(f"region {self.name!r}: cannot check its shared memory: {exc}") from None
        if size < needed:
            raise RegionMemoryGone(f"region {self.name!r}: its shared memory {self.shm_name!r} was truncated to "
                                   f"{size} bytes, the layout needs {needed}; delete the region and register it again")

    def named_segment(self) -> os.stat_result | None:
        """A shm region's segment (its file's status) if its name still names it, as a same-host
        sender opens it by the name; None where the worker unlinked the name or gave it to
        another segment, or the region is not shm: it is then reached over the wire only."""
        if self._segment_fd < 0:
            return None
        try:
            mine, named = os.fstat(self._segment_fd), os.stat(os.path.join(SHM_DIR, self.shm_name))
        except OSError:
            return None
        return mine if (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino) else None

    @property
    def layout(self) -> BlockLayout | None:
        """What the block's axes mean, for codecs that model KV by position (None: not named).
        Every codec binding passes here before a block is touched, a receiver's admission of a
        transfer included, so the memory is checked here too.

        Raises:
            RegionMemoryGone: as ``tensor``.
        """
        self.check_memory()
        return BlockLayout.of(self.block_shape, self.axes)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one block (fixed for the region's life; asked for on every transfer's path)."""
        return math.prod(self.block_shape) * self._tensor.element_size()

    def describe(self) -> dict[str, Any]:
        try:
            self.check_memory()
            memory = "ok"
        except RegionMemoryGone as exc:
            memory = str(exc)
        return {"name": self.name, "kind": self.kind, "num_blocks": self.num_blocks,
                "block_shape": list(self.block_shape), "dtype": self.dtype, "device": str(self._tensor.device),
                "block_bytes": self.block_bytes, "busy_transfers": sorted(self.busy),
                "axes": list(self.axes) if self.axes else None, "memory": memory, "quarantined": self.quarantined,
                "view_of": self.view_of,
                # what codecs learned from the data: "settled" once learned with the block's axes
                # (or without, where none are named); before that, a quick codebook in use
                "learned": {name: {"age_s": round(time.monotonic() - when, 3), "settled": settled, "blocks": blocks}
                            for name, (_, when, settled, blocks) in self.learned.items()}}

    def resolve(self, blocks: Blocks | list[int]) -> torch.Tensor:
        """Block ids as an index tensor on the region's device (checked once, here), and the
        memory checked (``tensor``).

        Raises:
            InvalidBlocks: empty, out of range, or repeated ids. RegionMemoryGone.
        """
        return Blocks.of(blocks).resolve(self.num_blocks, self.tensor.device)

    def write_run(self, start: int, data: bytes | bytearray) -> None:
        """Overwrite blocks ``start``, ``start + 1``, ... with their raw bytes, concatenated (a
        whole number of blocks), in one copy.

        Raises:
            InvalidBlocks: the run is empty or leaves the region. BadRequest: not whole blocks.
            Conflict: a transfer uses the region. RegionMemoryGone.
        """
        count, rest = divmod(len(data), self.block_bytes)
        if rest or not count:
            raise BadRequest(f"blocks of {self.name!r} are {self.block_bytes} bytes each; got {len(data)} bytes")
        if start < 0 or start + count > self.num_blocks:
            raise InvalidBlocks(f"blocks {start} to {start + count - 1} are not all in region {self.name!r} "
                                f"of {self.num_blocks}")
        if self.busy:
            raise Conflict(f"region {self.name!r} is in use by a transfer")
        target = self.tensor[start:start + count].reshape(-1).view(torch.uint8)  # a view: the slice is contiguous
        target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def release(self) -> None:
        if self.view_of is not None:  # the memory is its base region's, released with it
            self._tensor, self._segment_fd = torch.empty(0), -1
        elif self.kind == "shm" and self._keepalive is not None:
            self._tensor = torch.empty(0)
            self._segment_fd = -1
            close_segment(self._keepalive)
        elif self.kind == "cuda_ipc" and self._keepalive is not None:
            import cupy

            self._tensor = torch.empty(0)
            cupy.cuda.runtime.ipcCloseMemHandle(self._keepalive)
        self._keepalive = None


class RegionTable:
    """The registered regions. ``max_bytes`` caps one owned region (413 above it); 0 takes
    ``default_max_bytes(device)``. Whether an owned region fits is also checked against the
    memory free at the time (507 if not), so that a region never takes the memory the host needs."""

    def __init__(self, device: torch.device, max_bytes: int = 1 << 62, shm_prefix: str = "kvferry-"):
        self.device = device
        self._regions: dict[str, Region] = {}
        # Changes whenever memory is registered or let go (what views of peers' memory are checked
        # against); a view of a region (a lease's name over memory already here) changes nothing.
        self.version = 0
        self._max_bytes = max_bytes or default_max_bytes(device)
        self._shm_prefix = shm_prefix
        self._allocating = threading.Lock()  # one owned allocation at a time: each sees what the last took
        # Called with a region's name once it is deleted, whichever front end asked (a lease of it ends).
        self.deleted: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        return len(self._regions)

    def get(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise NotFound(f"no region named {name!r}") from None

    def find(self, name: str) -> Region | None:
        return self._regions.get(name)

    def all(self) -> list[Region]:
        return list(self._regions.values())

    def memories(self) -> list[Region]:
        """The regions that hold memory of their own: every one but views."""
        return [r for r in list(self._regions.values()) if r.view_of is None]  # asked from writing threads too

    def register(self, spec: RegionSpec) -> Region:
        """Create a region (``prepare`` then ``add``).

        Raises:
            Conflict: the name is taken. BadRequest: inconsistent layout or unusable memory.
            PayloadTooLarge: an owned region above the memory budget.
        """
        return self.add(self.prepare(spec))

    def add(self, region: Region) -> Region:
        """Raises: Conflict (the name was taken meanwhile; the region is released)."""
        if region.name in self._regions:
            region.release()
            raise Conflict(f"region {region.name!r} already exists")
        self._regions[region.name] = region
        if region.view_of is None:
            self.version += 1
        return region

    def prepare(self, spec: RegionSpec) -> Region:
        """Validate ``spec`` and allocate or map its memory, without adding it (so a large
        allocation may run off the event loop).

        Raises:
            Conflict, BadRequest, PayloadTooLarge: as ``register``.
        """
        name = spec.name
        if name in self._regions:
            raise Conflict(f"region {name!r} already exists")
        if spec.dtype not in DTYPES:
            raise BadRequest(f"dtype must be one of {sorted(DTYPES)}, not {spec.dtype!r}")
        if spec.num_blocks <= 0 or not spec.block_shape or min(spec.block_shape) <= 0:
            raise BadRequest("a region needs at least one block of a non-empty shape")
        try:
            BlockLayout.of(spec.block_shape, spec.axes)
        except CodebookMismatch as exc:
            raise BadRequest(f"axes {list(spec.axes or ())}: {exc}") from None
        dtype = DTYPES[spec.dtype]
        shape = (spec.num_blocks, *spec.block_shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if spec.kind == "owned" and nbytes > self._max_bytes:
            raise PayloadTooLarge(f"region {name!r} of {nbytes} bytes is over the {self._max_bytes}-byte budget "
                                  "(max_region_bytes)")
        keepalive, fd = None, -1
        if spec.kind == "owned":
            tensor = self._allocate(name, shape, dtype, nbytes)
        elif spec.kind == "shm":
            if not spec.shm_name:
                raise BadRequest("kind=shm needs shm_name")
            if not spec.shm_name.startswith(self._shm_prefix) or "/" in spec.shm_name:
                raise BadRequest(f"shm_name must start with {self._shm_prefix!r} (shm_prefix) and hold no '/'")
            tensor, keepalive = _map_shm(spec.shm_name, shape, dtype)
            fd = keepalive._fd
        elif spec.kind == "cuda_ipc":
            if not spec.ipc_handle:
                raise BadRequest("kind=cuda_ipc needs ipc_handle")
            tensor, keepalive = _open_cuda_ipc(spec, shape, dtype)
        else:
            raise BadRequest(f"unknown region kind {spec.kind!r}")
        export = ((base64.b64decode(spec.ipc_handle), spec.offset) if spec.kind == "cuda_ipc" else None)
        return Region(name, spec.kind, spec.num_blocks, tuple(spec.block_shape), spec.dtype, tensor,
                      axes=tuple(spec.axes) if spec.axes else None, ipc_export=export,
                      shm_name=spec.shm_name if spec.kind == "shm" else "", _keepalive=keepalive,
                      _segment_fd=fd)

    def view(self, name: str, of: str) -> Region:
        """Region ``name`` over the memory of region ``of``: a lease of a worker's registered
        cache costs a name, not a mapping (opening a CUDA IPC handle again takes milliseconds).
        The base is not deleted while a view of it exists.

        Raises:
            NotFound: no region ``of``. Conflict: the name is taken, ``of`` is being deleted (a view
            made while its delete waits would outlive the memory) or quarantined. BadRequest:
            ``of`` is a view.
        """
        base = self.get(of)
        if base.view_of is not None:
            raise BadRequest(f"region {of!r} is a view of {base.view_of!r}: view that region instead")
        if base.deleting:
            raise Conflict(f"region {of!r} is being deleted")
        if base.quarantined:  # a view would take transfers into memory a silent sender may still write
            raise Conflict(f"region {of!r} is quarantined: {base.quarantined}")
        if name in self._regions:
            raise Conflict(f"region {name!r} already exists")
        return self.add(Region(name, base.kind, base.num_blocks, base.block_shape, base.dtype, base._tensor,
                               axes=base.axes, ipc_export=base.ipc_export, shm_name=base.shm_name,
                               _segment_fd=base._segment_fd, view_of=of))

    def views(self, of: str) -> list[str]:
        return [r.name for r in self._regions.values() if r.view_of == of]

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """Zeroed memory for an owned region, if it fits in what is free now.

        Zeroing touches every page: an allocation the kernel grants by overcommit but cannot
        back would end the process in the OOM killer's hands, so free memory is checked first.
        On a GPU the region is an allocation of its own (``ipc.own_allocation``): it is lent to
        same-host senders as a CUDA IPC handle, which maps the whole allocation, and torch's
        allocator would put other tensors of this sidecar beside it.

        Raises:
            InsufficientStorage: not enough free memory, or the allocator refused.
        """
        with self._allocating:
            free = free_bytes(self.device)
            if free is not None and nbytes > free - HEADROOM_BYTES:
                raise InsufficientStorage(f"region {name!r} needs {nbytes} bytes of {self.device} memory; {free} are "
                                          f"free, and {HEADROOM_BYTES} stay free for the sidecar itself")
            try:
                if self.device.type == "cuda" and ipc.available():
                    return ipc.own_allocation(nbytes, self.device).view(dtype).view(shape)
                return torch.zeros(shape, dtype=dtype, device=self.device)
            except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                raise InsufficientStorage(f"cannot allocate region {name!r} of {nbytes} bytes on {self.device}: "
                                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    def delete(self, name: str) -> None:
        """Raises: NotFound. Conflict (a transfer uses it, or views of it exist)."""
        region = self.get(name)
        if region.busy:
            raise Conflict(f"region {name!r} is in use by transfers {sorted(region.busy)}")
        views = self.views(name)
        if views:
            raise Conflict(f"region {name!r} has views {sorted(views)[:8]}: delete them first")
        del self._regions[name]
        if region.view_of is None:
            self.version += 1
        region.release()
        for listener in self.deleted:
            listener(name)

    def close(self) -> None:
        for region in self._regions.values():
            region.release()
        self._regions.clear()


def default_max_bytes(device: torch.device) -> int:
    """The cap on one owned region when ``max_region_bytes`` is 0: half the memory of the
    device owned regions live on (the GPU's, or the host's within its cgroup limit), read at
    start-up. A fixed cap would exceed small hosts' memory or starve large ones; half leaves
    room for the codec's buffers, another region and the worker that shares the host."""
    total = total_bytes(device)
    return max(1, total // 2) if total else 64 << 30


def total_bytes(device: torch.device) -> int | None:
    """The memory of ``device``: a GPU's, or the host's within its cgroup limit (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = _meminfo().get("MemTotal")
    limit = _cgroup_limit()
    return min(x for x in (total, limit) if x is not None) if total or limit else None


def free_bytes(device: torch.device) -> int | None:
    """Memory an allocation on ``device`` may take now: a GPU's free memory (torch's cached
    blocks included); the host's available memory, within its cgroup limit (None: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available = _meminfo().get("MemAvailable")
    limit = _cgroup_limit()
    if limit is not None:
        used = _read_int("/sys/fs/cgroup/memory.current") or _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
        if used is not None:
            reclaimable = _cgroup_stat().get("inactive_file", 0)
            in_group = max(0, limit - used + reclaimable)
            available = in_group if available is None else min(available, in_group)
    return available


def _meminfo() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return values


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2, or v1), None if there is none."""
    limit = _read_int("/sys/fs/cgroup/memory.max") or _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    return limit if limit is not None and limit < 1 << 60 else None  # v1 says "no limit" with a huge number


def _cgroup_stat() -> dict[str, int]:
    for path in ("/sys/fs/cgroup/memory.stat", "/sys/fs/cgroup/memory/memory.stat"):
        try:
            with open(path) as f:
                return {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2) if v.isdigit()}
        except OSError:
            continue
    return {}


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _map_shm(shm_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    import numpy as np

    try:
        shm = ipc.open_segment(shm_name)  # the worker's: never unlinked here, even if it fails to map
    except (ValueError, OSError) as exc:
        raise BadRequest(f"cannot open shared memory {shm_name!r}: {exc}") from exc
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if shm.size < nbytes:
        shm.close()
        raise BadRequest(f"shared memory {shm_name!r} holds {shm.size} bytes, the layout needs {nbytes}")
    flat = torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8, count=nbytes))
    return flat.view(dtype).view(shape), shm


def _open_cuda_ipc(spec: RegionSpec, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    if not torch.cuda.is_available():
        raise BadRequest("cuda_ipc regions need a GPU")
    import cupy

    device = int(spec.device or 0)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        handle = base64.b64decode(spec.ipc_handle, validate=True)
        with cupy.cuda.Device(device):
            base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    except Exception as exc:
        raise BadRequest(f"cannot open CUDA IPC handle: {exc}") from exc
    offset = int(spec.offset or 0)
    try:  # the worker's word on where its blocks lie, held to the allocation its handle maps
        start, size = ipc.address_range(base)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize or base - start + offset + nbytes > size:
            raise BadRequest(f"{nbytes} bytes at offset {offset} are not inside the handle's {size}-byte "
                             f"allocation, aligned to {itemsize} bytes")
    except (BadRequest, RuntimeError) as exc:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.ipcCloseMemHandle(base)
        if isinstance(exc, BadRequest):
            raise
        raise BadRequest(f"cannot size the handle's allocation: {exc}") from None
    memory = cupy.cuda.UnownedMemory(base + offset, nbytes, owner=None, device_id=device)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    tensor = torch.as_tensor(array, device=f"cuda:{device}").view(dtype).view(shape)
    return tensor, base
