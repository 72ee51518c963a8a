"""vLLM's KV cache as a kvferry region: its layout (``CacheLayout``) and its registration with the
local sidecar (``KvCache``).

A mirror (every CPU cache, and a GPU one whose layers do not lie end to end) is head-major and
cut in granules of ``GRANULE`` tokens: its region block ``(b * heads + h) * pieces + p`` holds
tokens ``p * GRANULE`` onwards of KV head ``h`` of vLLM block ``b`` across every layer. A transfer
can then take any run of heads of any blocks, or any granules of them, as spread block ids: a
decode running another tensor-parallel size pulls exactly the heads it holds from each prefill
rank, one running another block size the granules each of its blocks holds, and the sidecar
writes them where they go. The re-layout costs no pass beyond the copy into the mirror that a CPU
cache makes anyway.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvferry.engine.errors import EngineError

from .sdk import Client, packed

log = logging.getLogger("kvferry.vllm")

DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float8_e5m2": "float8_e5m2",
          "torch.float8_e4m3fn": "float8_e4m3fn"}
FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # vLLM's cache_dtype names
# Tokens a mirror's block holds: vLLM's block sizes are multiples of 16 (CPU attention: of 32), so
# two instances of different block sizes cut their blocks into the same pieces.
GRANULE = 16


class IncompatibleCache(EngineError):
    """The two instances' KV caches cannot be exchanged block for block (block size, heads,
    head size, layer count or dtype differ)."""


@dataclass(frozen=True)
class CacheLayout:
    """vLLM's per-layer KV tensors as kvferry blocks, one of two ways:

    * a mirror (``in_place`` false), head-major: region block ``(b * heads + h) * pieces + p``
      holds granule ``p`` (``GRANULE`` tokens) of KV head ``h`` of page ``b`` of every layer
      (``[layers, *page without its head dimension, its token dimension a granule]``), so a run
      of heads of a block is a run of region blocks. A page with no head dimension (MLA's
      latent, or a layout whose heads were not named) is one "head"; one whose tokens were not
      found (no block size given) is one piece;
    * vLLM's own memory (``in_place``), where the layers lie end to end in one allocation: the
      region's blocks are the contiguous pieces of it, one per (layer, leading plane such as K
      or V, vLLM block) in memory order, so vLLM block ``b`` is ``planes`` region blocks, ``b``
      plus multiples of ``num_blocks``: one id spread ``num_blocks`` apart. Whole blocks only.
    """

    num_blocks: int
    num_layers: int
    page_shape: tuple[int, ...]  # one layer's page: the layer tensor without its block dimension
    block_dims: tuple[int, ...]  # which dimension of each layer tensor counts blocks
    dtype: str
    in_place: bool = False
    head_dim: int | None = None  # which dimension of a page counts KV heads (None: no such dimension)
    token_dim: int | None = None  # which dimension of a page counts a block's tokens (None: not known)
    pieces: int = 1  # a mirror's granules per KV head of a block

    @property
    def heads(self) -> int:
        """KV heads per page (1 without a head dimension)."""
        return 1 if self.head_dim is None else self.page_shape[self.head_dim]

    @property
    def granule(self) -> int | None:
        """Tokens a mirror's region block holds (None: whole pages only, in place or tokens unknown)."""
        if self.in_place or self.token_dim is None:
            return None
        return self.page_shape[self.token_dim] // self.pieces

    @property
    def planes(self) -> int:
        """Region blocks per vLLM block."""
        if not self.in_place:
            return self.heads * self.pieces
        return self.num_layers * math.prod(self.page_shape[:self.block_dims[0]])

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.in_place:
            return self.page_shape[self.block_dims[0]:]
        return (self.num_layers, *(n // self.pieces if i == self.token_dim else n
                                   for i, n in enumerate(self.page_shape) if i != self.head_dim))

    @property
    def token_axis(self) -> int | None:
        """The token dimension's place in a page without its head dimension."""
        if self.token_dim is None:
            return None
        return self.token_dim - (self.head_dim is not None and self.token_dim > self.head_dim)

    def blocks(self, block_ids: Sequence[int], num_blocks: int | None = None, first_head: int = 0,
               count: int | None = None, heads: int | None = None, pieces: int | None = None) -> dict[str, Any]:
        """vLLM block ids as region blocks, packed (``kvferry.client.packed``): of this cache, or of
        a prefill's of ``num_blocks`` vLLM blocks, ``heads`` heads a page and ``pieces`` granules
        a head; with ``first_head`` and ``count``, only those heads of each block (a mirror's).

        Raises: IncompatibleCache for part of a block of an in-place cache."""
        heads = self.heads if heads is None else heads
        count = heads if count is None else count
        if self.in_place:
            if (first_head, count) != (0, heads):
                raise IncompatibleCache("a cache lent in place (in_place) moves whole blocks: a different "
                                        "tensor-parallel size needs in_place: false on both instances")
            stride = self.num_blocks if num_blocks is None else num_blocks
            return packed(block_ids, self.planes, stride)
        pieces = self.pieces if pieces is None else pieces
        if heads * pieces == 1:
            return packed(block_ids)
        return packed([(int(b) * heads + first_head) * pieces for b in block_ids], count * pieces, 1)

    def granules(self, granule_ids: Sequence[int], first_head: int = 0, count: int | None = None,
                 heads: int | None = None, pieces: int | None = None) -> dict[str, Any]:
        """Granules ``b * pieces + p`` (piece ``p`` of vLLM block ``b``) of a mirror as region
        blocks, packed: of this cache, or of a prefill's of ``heads`` heads a page and ``pieces``
        granules a head; with ``first_head`` and ``count``, only those heads.

        Raises: IncompatibleCache for a cache without granules (in place, or tokens unknown)."""
        if self.granule is None:
            raise IncompatibleCache("a cache lent in place (in_place) moves whole blocks: instances of different "
                                    "block sizes need in_place: false on both")
        heads = self.heads if heads is None else heads
        count = heads if count is None else count
        pieces = self.pieces if pieces is None else pieces
        return packed([(int(g) // pieces * heads + first_head) * pieces + int(g) % pieces for g in granule_ids],
                      count, pieces)

    def in_place_view(self, layers: Sequence[Any]) -> Any | None:
        """The region over vLLM's own memory (``[num_blocks * planes, *block_shape]``), or None
        where the layers do not lie end to end in one allocation in the same layout."""
        import torch

        if len(set(self.block_dims)) != 1 or any(not t.is_contiguous() for t in layers):
            return None
        first = layers[0]
        if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
               or t.data_ptr() != first.data_ptr() + i * first.nbytes for i, t in enumerate(layers)):
            return None
        placed = replace(self, in_place=True)
        shape = (self.num_blocks * placed.planes, *placed.block_shape)  # the layers' span, end to end
        return torch.as_strided(first, shape, torch.empty(shape, device="meta").stride(), first.storage_offset())

    @classmethod
    def of(cls, layers: Sequence[Any], num_blocks: int, fp8: str | None = None, heads: int | None = None,
           head_dim: int | None = None, block_size: int | None = None) -> CacheLayout:
        """The layout of ``layers`` (distinct tensors); ``fp8``: the float8 type a uint8 cache
        holds (vLLM keeps FP8 caches as bytes); ``heads``: KV heads a page holds, found as the one
        page dimension of that size unless ``head_dim`` names it; ``block_size``: the tokens a
        page holds, whose dimension a mirror cuts in granules (without it, pages stay whole).

        Raises: IncompatibleCache for layouts kvferry cannot carry (mixed shapes or dtypes,
        no dimension of ``num_blocks``, float32, bytes that are not FP8, heads not found)."""
        if not layers:
            raise IncompatibleCache("vLLM registered no KV cache tensors")
        name = str(layers[0].dtype)
        dtype = fp8 if name == "torch.uint8" and fp8 else DTYPES.get(name)
        if dtype is None:
            raise IncompatibleCache(f"kvferry moves bf16, fp16 and fp8 KV caches, not {layers[0].dtype}"
                                    + (" without an FP8 --kv-cache-dtype" if name == "torch.uint8" else ""))
        dims, pages = [], set()
        for t in layers:
            if str(t.dtype) != name:
                raise IncompatibleCache("the KV cache layers mix dtypes")
            candidates = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not candidates:
                raise IncompatibleCache(f"no dimension of a KV layer {list(t.shape)} counts the {num_blocks} blocks")
            d = candidates[0]
            dims.append(d)
            pages.add(tuple(n for i, n in enumerate(t.shape) if i != d))
        if len(pages) != 1:
            raise IncompatibleCache(f"the KV cache layers differ in shape: {sorted(pages)} (kvferry carries "
                                    "attention KV of one page shape, not Mamba or other state)")
        page = pages.pop()
        if head_dim is None and heads is not None:
            found = [i for i, n in enumerate(page[:-1]) if n == heads]
            if len(found) > 1 or (not found and heads > 1):
                raise IncompatibleCache(f"cannot tell which dimension of a KV page {list(page)} counts its {heads} "
                                        "heads")
            head_dim = found[0] if found else None  # one head, no dimension of 1: a page without heads (MLA)
        if head_dim is not None and (not 0 <= head_dim < len(page) - 1 or (heads and page[head_dim] != heads)):
            raise IncompatibleCache(f"dimension {head_dim} of a KV page {list(page)} does not count {heads} heads")
        # the tokens: the first dimension of the block size that is neither the heads' nor the last (a head's width)
        tokens = next((i for i, n in enumerate(page[:-1]) if n == block_size and i != head_dim), None)
        pieces = 1 if tokens is None else page[tokens] // math.gcd(page[tokens], GRANULE)
        return cls(num_blocks, len(layers), page, tuple(dims), dtype, head_dim=head_dim, token_dim=tokens,
                   pieces=pieces)

    def check_peer(self, remote: Mapping[str, Any], where: str, heads: int | None = None,
                   pieces: int | None = None) -> int:
        """The number of vLLM blocks of a prefill's cache (its region's description, ``heads``
        KV heads and ``pieces`` granules a page: ours by default), once its blocks are known to
        fit ours; else refused, with what differs.

        Raises: IncompatibleCache.
        """
        shape, dtype = tuple(remote["block_shape"]), remote["dtype"]
        if self.in_place:
            planes = self.planes
        else:
            planes = (self.heads if heads is None else heads) * (self.pieces if pieces is None else pieces)
        if shape == self.block_shape and dtype == self.dtype and remote["num_blocks"] % planes == 0:
            return remote["num_blocks"] // planes
        raise IncompatibleCache(
            f"the prefill's KV cache at {where} holds {dtype}{list(shape)} blocks, this decode's "
            f"{self.dtype}{list(self.block_shape)} "
            f"({'in place' if self.in_place else '[layers, *page] per KV head and granule: a mirror'}): "
            "a different head layout, layer count or dtype cannot be transferred, nor a different block size "
            "in place; run both instances with the same model and --kv-cache-dtype (and the same in_place "
            "setting; different tensor-parallel or block sizes need in_place: false on both)")


class KvCache:
    """The worker's KV cache registered with its sidecar once, as region ``name`` (its layout:
    ``CacheLayout``).

    CPU (``shm``): vLLM owns its allocation, so the region is a POSIX shared-memory mirror the
    sidecar maps; ``save``/``load`` copy a request's pages between vLLM's tensors and the mirror.
    GPU (``cuda_ipc``): where vLLM's layers lie end to end in one allocation (as vLLM allocates
    them), the sidecar maps that memory itself, through CUDA IPC (``CacheLayout.in_place``):
    transfers read and write vLLM's pages, and ``save``/``load`` copy nothing. Else the mirror is a
    device buffer the sidecar maps, and the copies are device gathers, never through the host.

    Layers that share memory (vLLM's hybrid allocator overlays one layer of each KV cache group on
    the same tensor: a block belongs to one group at a time) are one layer here.
    """

    def __init__(self, client: Client, name: str, layers: Sequence[Any], num_blocks: int,
                 shm_prefix: str = "kvferry-", in_place: bool = True, fp8: str | None = None,
                 heads: int | None = None, head_dim: int | None = None, block_size: int | None = None):
        import uuid

        import torch

        self.client, self.name = client, name
        self.layers = distinct(layers)
        self.layout = CacheLayout.of(self.layers, num_blocks, fp8=fp8, heads=heads, head_dim=head_dim,
                                     block_size=block_size)
        self.device = self.layers[0].device
        shape = (num_blocks, self.layout.heads, self.layout.pieces, *self.layout.block_shape)
        region = (num_blocks * self.layout.heads * self.layout.pieces, *self.layout.block_shape)
        dtype = getattr(torch, self.layout.dtype)
        self._shm = None
        if self.device.type == "cuda":
            view = self.layout.in_place_view(self.layers) if in_place else None
            if view is not None:
                self.layout = replace(self.layout, in_place=True)
            self.mirror = None if view is not None else torch.empty(shape, dtype=self.layers[0].dtype,
                                                                    device=self.device)
            lent = (view if view is not None else self.mirror.view(region)).view(dtype)
            self.kind = "cuda_ipc"
            self._register(lambda n: client.region_from_tensor(n, lent, kind="cuda_ipc")[0])
        else:
            from multiprocessing import shared_memory

            nbytes = math.prod(shape) * self.layers[0].element_size()
            self._shm = shared_memory.SharedMemory(name=f"{shm_prefix}{uuid.uuid4().hex}", create=True,
                                                   size=max(1, nbytes))
            os.fchmod(self._shm._fd, 0o660)  # the sidecar may run as another user of the pod's group
            flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            self.mirror = flat.view(self.layers[0].dtype).view(shape)
            self.kind = "shm"
            self._register(lambda n: client.create_region(n, region[0], list(self.layout.block_shape),
                                                          self.layout.dtype, kind="shm", shm_name=self._shm.name))
        self._ipc = None

    def _register(self, create) -> None:
        """Register, replacing a region of that name left by a previous run of this worker."""
        from kvferry.engine.errors import Conflict

        self._create = create
        try:
            create(self.name)
        except Conflict:
            self._delete()
            create(self.name)

    def _delete(self) -> None:
        """Delete the registered region, and first the leases' views of it (a worker that goes
        away, or a previous run's, leaves no lease on its memory)."""
        from kvferry.engine.errors import Conflict

        try:
            self.client.delete_region(self.name)
        except Conflict:
            for region in self.client.list_regions():
                if region.get("view_of") == self.name:
                    self.client.delete_region(region["name"], force=True)
            self.client.delete_region(self.name)

    def alias(self, name: str) -> None:
        """Another region over the same memory (a lease)."""
        self._create(name)

    def save(self, block_ids: Sequence[int]) -> None:
        """Copy the pages of ``block_ids`` of every layer from vLLM's cache into the mirror."""
        if self.layout.in_place:
            return
        import torch

        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (t, d) in enumerate(zip(self.layers, self.layout.block_dims)):
            self.mirror[ids, :, :, layer] = self._to_mirror(t.index_select(d, ids).movedim(d, 0))

    def load(self, block_ids: Sequence[int]) -> None:
        """Copy the pages of ``block_ids`` of every layer from the mirror into vLLM's cache."""
        if self.layout.in_place:
            return
        import torch

        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (t, d) in enumerate(zip(self.layers, self.layout.block_dims)):
            t.index_copy_(d, ids, self._from_mirror(self.mirror[ids, :, :, layer]).movedim(0, d))

    def _to_mirror(self, pages: Any) -> Any:
        """``[n, *page]`` as ``[n, heads, pieces, *page without heads, tokens a granule]``: the
        mirror's order."""
        layout = self.layout
        head = layout.head_dim
        pages = pages.unsqueeze(1) if head is None else pages.movedim(1 + head, 1)
        axis = layout.token_axis
        if axis is None:
            return pages.unsqueeze(2)
        return pages.unflatten(2 + axis, (layout.pieces, -1)).movedim(2 + axis, 2)

    def _from_mirror(self, pieces: Any) -> Any:
        layout = self.layout
        axis = layout.token_axis
        pages = pieces.squeeze(2) if axis is None else pieces.movedim(2, 2 + axis).flatten(2 + axis, 3 + axis)
        head = layout.head_dim
        return pages.squeeze(1) if head is None else pages.movedim(1, 1 + head)

    def close(self) -> None:
        try:
            self._delete()
        except (EngineError, httpx.HTTPError) as exc:
            log.warning("could not delete region %s: %s", self.name, exc)
        if self._shm is not None:
            self.mirror = None
            self._shm.close()
            self._shm.unlink()
            self._shm = None



def distinct(layers: Sequence[Any]) -> list[Any]:
    """The layer tensors without repeats: vLLM's hybrid allocator hands the same memory under one
    layer name per KV cache group.

    Raises: IncompatibleCache for tensors that overlap without being the same view."""
    seen: dict[int, Any] = {}
    for t in layers:
        other = seen.get(t.data_ptr())
        if other is None:
            seen[t.data_ptr()] = t
        elif tuple(other.shape) != tuple(t.shape) or other.stride() != t.stride() or other.dtype != t.dtype:
            raise IncompatibleCache("two KV cache layers share memory in different shapes")
    return list(seen.values())
