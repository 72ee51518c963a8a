"""Registered KV memory: a tensor of ``num_blocks`` blocks of ``block_shape`` (block i is the
i-th slice along dim 0), owned by the sidecar, mapped from a worker's POSIX shared memory, or
opened from a worker's CUDA IPC handle. Registered once; transfers then name blocks by index."""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.codec import BlockLayout, CodebookMismatch

from .blocks import Blocks
from .errors import BadRequest, Conflict, NotFound, PayloadTooLarge

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e5m2": torch.float8_e5m2,
          "float8_e4m3fn": torch.float8_e4m3fn}


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
    name: str
    kind: str
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str
    tensor: torch.Tensor
    busy: set[str] = field(default_factory=set)  # ids of transfers reading or writing it
    axes: tuple[str, ...] | None = None
    ipc_export: tuple[bytes, int] | None = None  # cuda_ipc: the worker's (handle, offset), to lend on
    closing: bool = False  # being deleted: lent to no sender
    shm_name: str = ""  # shm: the segment's name (what a same-host sender is lent)
    learned: dict[str, tuple[Any, float, bool, int]] = field(default_factory=dict)  # codec -> (codebook, when, settled, blocks)
    _keepalive: Any = None  # the shared-memory mapping or IPC handle the tensor views

    @property
    def layout(self) -> BlockLayout | None:
        """What the block's axes mean, for codecs that model KV by position (None: not named)."""
        return BlockLayout.of(self.block_shape, self.axes)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.tensor.element_size()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "num_blocks": self.num_blocks,
                "block_shape": list(self.block_shape), "dtype": self.dtype, "device": str(self.tensor.device),
                "block_bytes": self.block_bytes, "busy_transfers": sorted(self.busy),
                "axes": list(self.axes) if self.axes else None,
                # what codecs learned from the data: "settled" once learned with the block's axes
                # (or without, where none are named); before that, a quick codebook in use
                "learned": {name: {"age_s": round(time.monotonic() - when, 3), "settled": settled, "blocks": blocks}
                            for name, (_, when, settled, blocks) in self.learned.items()}}

    def resolve(self, blocks: Blocks | list[int]) -> torch.Tensor:
        """Block ids as an index tensor on the region's device (checked once, here).

        Raises:
            InvalidBlocks: empty, out of range, or repeated ids.
        """
        return Blocks.of(blocks).resolve(self.num_blocks, self.tensor.device)

    def release(self) -> None:
        if self.kind == "shm" and self._keepalive is not None:
            self.tensor = torch.empty(0)
            self._keepalive.close()
        elif self.kind == "cuda_ipc" and self._keepalive is not None:
            import cupy

            self.tensor = torch.empty(0)
            cupy.cuda.runtime.ipcCloseMemHandle(self._keepalive)
        self._keepalive = None


class RegionTable:
    def __init__(self, device: torch.device, max_bytes: int = 1 << 62, shm_prefix: str = "kvferry-"):
        self.device = device
        self._regions: dict[str, Region] = {}
        self._max_bytes = max_bytes
        self._shm_prefix = shm_prefix

    def __len__(self) -> int:
        return len(self._regions)

    def get(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise NotFound(f"no region named {name!r}") from None

    def all(self) -> list[Region]:
        return list(self._regions.values())

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
        keepalive = None
        if spec.kind == "owned":
            tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        elif spec.kind == "shm":
            if not spec.shm_name:
                raise BadRequest("kind=shm needs shm_name")
            if not spec.shm_name.startswith(self._shm_prefix) or "/" in spec.shm_name:
                raise BadRequest(f"shm_name must start with {self._shm_prefix!r} (shm_prefix) and hold no '/'")
            tensor, keepalive = _map_shm(spec.shm_name, shape, dtype)
        elif spec.kind == "cuda_ipc":
            if not spec.ipc_handle:
                raise BadRequest("kind=cuda_ipc needs ipc_handle")
            tensor, keepalive = _open_cuda_ipc(spec, shape, dtype)
        else:
            raise BadRequest(f"unknown region kind {spec.kind!r}")
        export = ((base64.b64decode(spec.ipc_handle), spec.offset) if spec.kind == "cuda_ipc" else None)
        return Region(name, spec.kind, spec.num_blocks, tuple(spec.block_shape), spec.dtype, tensor,
                      axes=tuple(spec.axes) if spec.axes else None, ipc_export=export,
                      shm_name=spec.shm_name if spec.kind == "shm" else "", _keepalive=keepalive)

    def delete(self, name: str) -> None:
        region = self.get(name)
        if region.busy:
            raise Conflict(f"region {name!r} is in use by transfers {sorted(region.busy)}")
        del self._regions[name]
        region.release()

    def close(self) -> None:
        for region in self._regions.values():
            region.release()
        self._regions.clear()


def _map_shm(shm_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    from multiprocessing import resource_tracker, shared_memory

    import numpy as np

    try:
        shm = shared_memory.SharedMemory(name=shm_name, create=False)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise BadRequest(f"cannot open shared memory {shm_name!r}: {exc}") from exc
    # The worker owns the segment: Python < 3.13 would unlink it when this process exits.
    resource_tracker.unregister(shm._name, "shared_memory")
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
    memory = cupy.cuda.UnownedMemory(base + int(spec.offset or 0), nbytes, owner=None, device_id=device)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    tensor = torch.as_tensor(array, device=f"cuda:{device}").view(dtype).view(shape)
    return tensor, base
