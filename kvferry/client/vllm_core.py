"""The vLLM connector's core, free of vLLM imports: what the connector asks the sidecars, which
blocks go where, and the leases that keep a prefill's blocks alive until the decode has them.

The flow (one kvferry transfer per request, all layers in it):

* Every vLLM worker registers its KV cache with its local sidecar once (``KvCache``): on a GPU the
  sidecar maps the worker's own memory (``cuda_ipc``, no copy); on the CPU vLLM owns the
  allocation, so the cache is mirrored in a POSIX shared-memory segment of ``num_blocks`` blocks,
  each holding every layer's page of that block, and pages are copied in (prefill) or out
  (decode) per request.
* Prefill (``Producer``): once a request's prompt is computed, its blocks are saved into the
  mirror and a *lease* is taken: a region named after the request on the prefill's sidecar, a
  view of the same memory. Its name goes back to vLLM in ``kv_transfer_params``; vLLM keeps the
  blocks until the producer reports the request sent. That happens when the lease region is
  gone (the decode deletes it once its pull ended) or when the lease expires (then the producer
  deletes it itself, but never while a transfer reads it), so blocks are never stranded and a
  late pull can never read reused blocks: it finds no region.
* Decode (``Consumer``): once vLLM has allocated blocks for a request, the consumer asks the
  *prefill's* sidecar to send the lease's blocks to its own sidecar's region (one transfer,
  pull semantics over kvferry's push API) on a worker thread, in one HTTP call that answers at the
  transfer's end (so vLLM's step never waits on HTTP and sees the end as soon as it comes), copies the pages into
  vLLM's cache, deletes the lease and reports the request received; a failure is reported as
  such, so vLLM's ``kv_load_failure_policy`` (fail or recompute) applies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvferry.engine.errors import EngineError, NotFound

from .sdk import Answer, Client, packed

log = logging.getLogger("kvferry.vllm")

DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float8_e5m2": "float8_e5m2",
          "torch.float8_e4m3fn": "float8_e4m3fn"}
PARAMS_KEY = "kvferry"  # our part of vLLM's kv_transfer_params
WAITERS = 16  # a decode's pulls waited on at once (more wait for a thread)
LONG_POLL = 10.0  # seconds one long-poll of a transfer's end may take


class IncompatibleCache(EngineError):
    """The two instances' KV caches cannot be exchanged block for block (block size, heads,
    head size, layer count or dtype differ)."""


# ---- configuration -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorConfig:
    """Where the local sidecar is and how to transfer; from ``kv_connector_extra_config`` over
    ``KVFERRY_*`` environment variables over these defaults."""

    url: str = "http://127.0.0.1:7700"  # the local sidecar's control API
    token: str = ""  # its bearer token
    remote_token: str | None = None  # token of the prefill sidecars' APIs (default: token)
    advertise_url: str = ""  # how decodes reach the local sidecar's API (default: url)
    codec: str = "auto"
    lease_seconds: float = 30.0  # a prefill frees a request's blocks after this if nobody pulled
    load_timeout: float = 30.0  # a decode fails a pull that is not done by then
    poll_seconds: float = 0.005  # at most one lease poll of the local sidecar per this interval
    region: str = "vllm-kv"  # region name prefix
    stats_path: str = ""  # decode: append one JSON line per received request (wait, bytes, ratio)
    shm_prefix: str = "kvferry-"  # the local sidecar's shm_prefix setting (CPU mirrors are named so)
    in_place: bool = True  # GPU: lend vLLM's own cache where its layers lie end to end, else a mirror

    # KVFERRY_TOKEN and KVFERRY_SHM_PREFIX mean what they mean to the sidecar; the connector's own
    # settings are KVFERRY_CONNECTOR_* (a sidecar refuses KVFERRY_* names it does not know).
    ENV = {"url": "KVFERRY_CONNECTOR_URL", "token": "KVFERRY_TOKEN", "remote_token": "KVFERRY_CONNECTOR_REMOTE_TOKEN",
           "advertise_url": "KVFERRY_CONNECTOR_ADVERTISE_URL", "codec": "KVFERRY_CONNECTOR_CODEC",
           "lease_seconds": "KVFERRY_CONNECTOR_LEASE_SECONDS", "load_timeout": "KVFERRY_CONNECTOR_LOAD_TIMEOUT",
           "poll_seconds": "KVFERRY_CONNECTOR_POLL_SECONDS", "region": "KVFERRY_CONNECTOR_REGION",
           "stats_path": "KVFERRY_CONNECTOR_STATS_PATH", "shm_prefix": "KVFERRY_SHM_PREFIX",
           "in_place": "KVFERRY_CONNECTOR_IN_PLACE"}

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Raises: ValueError on an unknown key in ``extra`` (a typo must not pass silently)."""
        environ = os.environ if environ is None else environ
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.ENV)
        if unknown:
            raise ValueError(f"unknown kvferry settings in kv_connector_extra_config: {sorted(unknown)}; "
                             f"known: {sorted(cls.ENV)}")
        values: dict[str, Any] = {}
        for name, key in cls.ENV.items():
            if name in extra:
                values[name] = extra[name]
            elif key in environ:
                values[name] = environ[key]
        for name in ("lease_seconds", "load_timeout", "poll_seconds"):
            if name in values:
                values[name] = float(values[name])
        if isinstance(values.get("in_place"), str):
            flag = values["in_place"].strip().lower()
            if flag not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"in_place: {values['in_place']!r} is not true or false")
            values["in_place"] = flag in ("1", "true", "yes")
        return cls(**values)

    @property
    def public_url(self) -> str:
        return self.advertise_url or self.url

    def peer_token(self) -> str:
        return self.token if self.remote_token is None else self.remote_token


def lease_name(prefix: str, request_id: str) -> str:
    """The lease of a prefill request: a valid region name whatever the request id holds, the
    same in vLLM's scheduler and worker processes. Worker ``rank`` holds ``f"{lease}-r{rank}"``."""
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:24]
    return f"{prefix}-lease-{digest}"


# ---- the cache as the sidecar sees it ----------------------------------------------------------
@dataclass(frozen=True)
class CacheLayout:
    """vLLM's per-layer KV tensors as kvferry blocks, one of two ways:

    * a mirror (``in_place`` false): block ``b`` of the region holds page ``b`` of every layer
      (the slice at index ``b`` of each layer's block dimension);
    * vLLM's own memory (``in_place``), where the layers lie end to end in one allocation: the
      region's blocks are the contiguous pieces of it, one per (layer, leading plane such as K
      or V, vLLM block) in memory order, so vLLM block ``b`` is ``planes`` region blocks, ``b``
      plus multiples of ``num_blocks``: one id spread ``num_blocks`` apart.
    """

    num_blocks: int
    num_layers: int
    page_shape: tuple[int, ...]  # one layer's page: the layer tensor without its block dimension
    block_dims: tuple[int, ...]  # which dimension of each layer tensor counts blocks
    dtype: str
    in_place: bool = False

    @property
    def planes(self) -> int:
        """Region blocks per vLLM block."""
        if not self.in_place:
            return 1
        return self.num_layers * math.prod(self.page_shape[:self.block_dims[0]])

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.in_place:
            return self.page_shape[self.block_dims[0]:]
        return (self.num_layers, *self.page_shape)

    def blocks(self, block_ids: Sequence[int], num_blocks: int | None = None) -> dict[str, Any]:
        """vLLM block ids as this layout's region blocks (of a cache of ``num_blocks`` vLLM
        blocks: ours by default, or a prefill's), packed (``kvferry.client.packed``)."""
        if not self.in_place:
            return packed(block_ids)
        stride = self.num_blocks if num_blocks is None else num_blocks
        return packed(block_ids, self.planes, stride)

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
    def of(cls, layers: Sequence[Any], num_blocks: int) -> CacheLayout:
        """Raises: IncompatibleCache for layouts kvferry cannot carry (mixed shapes or dtypes,
        no dimension of ``num_blocks``, float32)."""
        if not layers:
            raise IncompatibleCache("vLLM registered no KV cache tensors")
        dtype = DTYPES.get(str(layers[0].dtype))
        if dtype is None:
            raise IncompatibleCache(f"kvferry moves bf16, fp16 and fp8 KV caches, not {layers[0].dtype}")
        dims, pages = [], set()
        for t in layers:
            if str(t.dtype) != str(layers[0].dtype):
                raise IncompatibleCache("the KV cache layers mix dtypes")
            candidates = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not candidates:
                raise IncompatibleCache(f"no dimension of a KV layer {list(t.shape)} counts the {num_blocks} blocks")
            d = candidates[0]
            dims.append(d)
            pages.add(tuple(n for i, n in enumerate(t.shape) if i != d))
        if len(pages) != 1:
            raise IncompatibleCache(f"the KV cache layers differ in shape: {sorted(pages)}")
        return cls(num_blocks, len(layers), pages.pop(), tuple(dims), dtype)

    def check_peer(self, remote: Mapping[str, Any], where: str) -> int:
        """The number of vLLM blocks of a prefill's cache (its region's description), once its
        blocks are known to fit ours; else refused, with what differs.

        Raises: IncompatibleCache.
        """
        shape, dtype = tuple(remote["block_shape"]), remote["dtype"]
        if shape == self.block_shape and dtype == self.dtype and remote["num_blocks"] % self.planes == 0:
            return remote["num_blocks"] // self.planes
        raise IncompatibleCache(
            f"the prefill's KV cache at {where} holds {dtype}{list(shape)} blocks, this decode's "
            f"{self.dtype}{list(self.block_shape)} ({'in place' if self.in_place else '[layers, *page]: a mirror'}): "
            "a different block size, head layout, layer count or dtype cannot be transferred; run both instances "
            "with the same model, --block-size and --kv-cache-dtype (and the same in_place setting)")


class KvCache:
    """The worker's KV cache registered with its sidecar once, as region ``name`` of
    ``num_blocks`` blocks, block ``b`` holding every layer's page ``b``.

    CPU (``shm``): vLLM owns its allocation, so the region is a POSIX shared-memory mirror the
    sidecar maps; ``save``/``load`` copy a request's pages between vLLM's tensors and the mirror.
    GPU (``cuda_ipc``): where vLLM's layers lie end to end in one allocation (as vLLM allocates
    them), the sidecar maps that memory itself, through CUDA IPC (``CacheLayout.in_place``):
    transfers read and write vLLM's pages, and ``save``/``load`` copy nothing. Else the mirror is a
    device buffer the sidecar maps, and the copies are device gathers, never through the host.
    """

    def __init__(self, client: Client, name: str, layers: Sequence[Any], num_blocks: int,
                 shm_prefix: str = "kvferry-", in_place: bool = True):
        import uuid

        import torch

        self.client, self.name = client, name
        self.layers = list(layers)
        self.layout = CacheLayout.of(self.layers, num_blocks)
        self.device = self.layers[0].device
        shape = (num_blocks, *self.layout.block_shape)
        self._shm = None
        if self.device.type == "cuda":
            view = self.layout.in_place_view(self.layers) if in_place else None
            if view is not None:
                self.layout = replace(self.layout, in_place=True)
            self.mirror = None if view is not None else torch.empty(shape, dtype=self.layers[0].dtype,
                                                                    device=self.device)
            lent = view if view is not None else self.mirror
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
            self._register(lambda n: client.create_region(n, num_blocks, list(self.layout.block_shape),
                                                          self.layout.dtype, kind="shm", shm_name=self._shm.name))
        self._ipc = None

    def _register(self, create) -> None:
        """Register, replacing a region of that name left by a previous run of this worker."""
        from kvferry.engine.errors import Conflict

        self._create = create
        try:
            create(self.name)
        except Conflict:
            self.client.delete_region(self.name)
            create(self.name)

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
            self.mirror[ids, layer] = t.index_select(d, ids).movedim(d, 0)

    def load(self, block_ids: Sequence[int]) -> None:
        """Copy the pages of ``block_ids`` of every layer from the mirror into vLLM's cache."""
        if self.layout.in_place:
            return
        import torch

        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (t, d) in enumerate(zip(self.layers, self.layout.block_dims)):
            t.index_copy_(d, ids, self.mirror[ids, layer].movedim(0, d))

    def close(self) -> None:
        try:
            self.client.delete_region(self.name)
        except (EngineError, httpx.HTTPError) as exc:
            log.warning("could not delete region %s: %s", self.name, exc)
        if self._shm is not None:
            self.mirror = None
            self._shm.close()
            self._shm.unlink()
            self._shm = None


# ---- prefill ------------------------------------------------------------------------------------
@dataclass
class Lease:
    request_id: str
    region: str
    deadline: float
    held: bool = True  # False once released (the decode took the blocks, or the lease lapsed)


class Producer:
    """Prefill worker: saves finished prompts' blocks, leases them, learns when they may be freed."""

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic):
        self.config, self.cache, self.rank, self.clock = config, cache, rank, clock
        self.leases: dict[str, Lease] = {}
        self._finished: set[str] = set()  # ids vLLM said finished (only those may be reported sent)
        self._last_poll = -math.inf

    def save(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        """Copy the request's blocks into the mirror and lease them. A lease that cannot be taken
        (sidecar down) is released at once: the blocks go back to vLLM and the decode's pull fails."""
        name = f"{lease_name(self.config.region, request_id)}-r{self.rank}"
        lease = Lease(request_id, name, self.clock() + self.config.lease_seconds)
        try:
            self.cache.save(block_ids)
            self.cache.alias(name)
        except (EngineError, httpx.HTTPError) as exc:
            log.error("kvferry: cannot lease the KV of request %s (%s); the decode will not get it", request_id, exc)
            lease.held = False
        self.leases[request_id] = lease
        return lease

    def abandon(self, request_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks itself (aborted): end their leases now."""
        for request_id in request_ids:
            lease = self.leases.pop(request_id, None)
            if lease is not None and lease.held:
                self._drop(lease, force=True)

    def finished_sending(self, finished_request_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks vLLM may free now (called every step)."""
        self._finished.update(finished_request_ids)
        now = self.clock()
        held = [lease for lease in self.leases.values() if lease.held]
        if held and now - self._last_poll >= self.config.poll_seconds:
            self._last_poll = now
            try:
                present = {r["name"] for r in self.cache.client.list_regions()}
            except (EngineError, httpx.HTTPError) as exc:
                log.warning("kvferry: cannot poll the sidecar for leases: %s", exc)
                present = None
            for lease in held:
                if present is not None and lease.region not in present:
                    lease.held = False  # the decode took the blocks and deleted the lease
                elif now >= lease.deadline:
                    self._drop(lease, force=False)
        done = {rid for rid, lease in self.leases.items() if not lease.held and rid in self._finished}
        for rid in done:
            del self.leases[rid]
            self._finished.discard(rid)
        return done

    def _drop(self, lease: Lease, force: bool) -> None:
        """Delete the lease region; while a transfer reads it (Conflict) keep it, unless forced
        (then the transfer is cancelled first)."""
        from kvferry.engine.errors import Conflict

        try:
            self.cache.client.delete_region(lease.region)
        except NotFound:
            pass
        except Conflict:
            if not force:
                return  # a pull is reading it: free once it ends
            for record in self.cache.client.region(lease.region).get("busy_transfers", []):
                self.cache.client.cancel(record)
            self.cache.client.delete_region(lease.region)
        except (EngineError, httpx.HTTPError) as exc:
            log.warning("kvferry: lease %s could not be deleted (%s); freeing its blocks anyway", lease.region, exc)
        lease.held = False
        log.info("kvferry: lease of request %s ended without a pull", lease.request_id)


# ---- decode -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """One request's pull: what the scheduler hands the worker."""

    request_id: str
    local_blocks: tuple[int, ...]
    params: Mapping[str, Any]  # our part of the prefill's kv_transfer_params


@dataclass
class Pull:
    spec: LoadSpec
    started: float
    client: Client | None = None
    transfer_id: str | None = None
    error: str | None = None
    record: dict[str, Any] = field(default_factory=dict)
    ended: Future | None = None  # the submit-and-wait on a worker thread: the transfer's record at its end
    answered: float = 0.0  # when that thread had the record (the consumer's clock)
    asked_wall: float = 0.0  # wall clock when the pull was sent and answered: lined up with the
    answered_wall: float = 0.0  # sidecar's record (``created``) where both run on one host
    load_seconds: float = 0.0  # copying the pages into vLLM's cache


def remote_params(request_id: str, block_ids: Sequence[int], config: ConnectorConfig,
                  num_tokens: int = 0) -> dict[str, Any]:
    """What a prefill hands the decode (inside vLLM's kv_transfer_params)."""
    return {"url": config.public_url, "lease": lease_name(config.region, request_id),
            "block_ids": [int(b) for b in block_ids], "num_tokens": int(num_tokens)}


def match_blocks(local: Sequence[int], remote: Sequence[int]) -> tuple[list[int], list[int]]:
    """Pair the decode's freshly allocated blocks with the prefill's: both end at the prompt's end,
    so the decode's (which skip whatever its own prefix cache held) match the prefill's last ones.

    Raises: IncompatibleCache when the decode wants more blocks than the prefill holds.
    """
    local = [int(b) for b in local]
    if len(local) > len(remote):
        raise IncompatibleCache(f"the decode allocated {len(local)} blocks for the prompt, the prefill holds "
                                f"{len(remote)}: the block sizes differ")
    return [int(b) for b in remote[len(remote) - len(local):]], local


class Consumer:
    """Decode worker: pulls each request's KV from its prefill's sidecar into the local cache."""

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic):
        self.config, self.cache, self.rank, self.clock = config, cache, rank, clock
        self.pulls: dict[str, Pull] = {}
        self.failed_blocks: dict[str, tuple[int, ...]] = {}  # request id -> its blocks that did not load
        self._clients: dict[str, Client] = {}
        self._checked: dict[str, int] = {}  # prefill sidecars whose layout matched ours -> their vLLM blocks
        self._data_address: str | None = None
        self.stats: list[dict[str, Any]] = []
        self._waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="kvferry-pull")

    def remote(self, url: str) -> Client:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = Client(url, token=self.config.peer_token(), timeout=10.0)
        return client

    def start(self, spec: LoadSpec) -> Pull:
        """Ask the prefill's sidecar to send; never raises (a failure is reported as a failed load).
        A spec without local blocks (nothing to load) only ends the prefill's lease."""
        pull = Pull(spec, self.clock())
        if not spec.local_blocks:
            self._release_later(pull)
            return pull
        self.pulls[spec.request_id] = pull
        try:
            url, lease = spec.params["url"], self._lease(spec)
            src, dst = match_blocks(spec.local_blocks, spec.params["block_ids"])
            pull.client = self.remote(url)
            if url not in self._checked:
                self._checked[url] = self.cache.layout.check_peer(pull.client.region(lease), url)
            layout = self.cache.layout
            src, dst = layout.blocks(src, self._checked[url]), layout.blocks(dst)
            if self._data_address is None:
                self._data_address = self.cache.client.data_address()
            codec = spec.params.get("codec") or self.config.codec  # a request may name its codec
            pull.asked_wall = time.time()
            answer = pull.client.send_later(lease, src, self._data_address, self.cache.name, dst, codec=codec,
                                            wait=min(LONG_POLL, self.config.load_timeout))
        except (EngineError, httpx.HTTPError, KeyError, TypeError) as exc:
            pull.error = f"{type(exc).__name__}: {exc}"
        else:
            pull.ended = self._waiters.submit(self._run, pull, answer)
        return pull

    def _run(self, pull: Pull, answer: Answer) -> dict[str, Any]:
        """On a worker thread: read the pull's answer (its record at the transfer's end, the
        request sent by ``start``), then long-poll (at most ``LONG_POLL`` seconds a call) until it
        ended or ``load_timeout`` passed; returns the transfer's last record."""
        deadline = time.monotonic() + self.config.load_timeout
        record = answer.result()
        pull.transfer_id = record["id"]
        while record["state"] in ("queued", "running"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            record = pull.client.transfer(pull.transfer_id, wait=min(LONG_POLL, left))
        pull.answered, pull.answered_wall = self.clock(), time.time()
        return record

    def poll(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids, each reported once; received ones are in vLLM's cache."""
        received, failed = set(), set()
        for rid, pull in list(self.pulls.items()):
            if pull.error is None and pull.ended is not None:
                timed_out = self.clock() - pull.started > self.config.load_timeout
                if not pull.ended.done() and not timed_out:
                    continue  # still on its way: nothing to ask anyone
                try:
                    if pull.ended.done():
                        pull.record = pull.ended.result()
                    elif pull.transfer_id is not None:
                        pull.record = pull.client.transfer(pull.transfer_id)
                    else:
                        pull.record = {"state": "queued"}  # the prefill's sidecar has not taken it yet
                except (EngineError, httpx.HTTPError) as exc:
                    pull.error = f"the pull from the prefill's sidecar failed: {type(exc).__name__}: {exc}"
                else:
                    state = pull.record["state"]
                    if state == "done":
                        try:
                            loading = self.clock()
                            self.cache.load(self._local_blocks(pull))
                            pull.load_seconds = self.clock() - loading
                        except Exception as exc:  # noqa: BLE001 (a copy failure is this request's failure)
                            pull.error = f"copying the pages into vLLM's cache failed: {exc}"
                    elif state in ("failed", "cancelled"):
                        pull.error = f"transfer {pull.transfer_id} {state}: {pull.record.get('error_kind')}: " \
                                     f"{pull.record.get('error')}"
                    elif timed_out:
                        pull.error = f"transfer {pull.transfer_id} not done after {self.config.load_timeout:g} s"
                        try:
                            if pull.transfer_id is not None:
                                pull.client.cancel(pull.transfer_id)
                        except (EngineError, httpx.HTTPError):
                            pass  # it may have ended meanwhile; the request fails either way
                    else:
                        continue
            del self.pulls[rid]
            if pull.error is None:
                received.add(rid)
                self._record(pull)
            else:
                failed.add(rid)
                self.failed_blocks[rid] = tuple(pull.spec.local_blocks)
                log.error("kvferry: KV of request %s not loaded: %s", rid, pull.error)
            self._release_later(pull)
        return received, failed

    def _local_blocks(self, pull: Pull) -> list[int]:
        return match_blocks(pull.spec.local_blocks, pull.spec.params["block_ids"])[1]

    def _lease(self, spec: LoadSpec) -> str:
        return f"{spec.params['lease']}-r{self.rank}"

    def _release_later(self, pull: Pull) -> None:
        """End the prefill's lease, whatever happened, on a worker thread: vLLM's step does not
        wait for that HTTP call, and the prefill frees the blocks once the lease is gone."""
        try:
            lease, url = self._lease(pull.spec), pull.spec.params["url"]
        except (KeyError, TypeError):
            return
        try:
            self._waiters.submit(self._release, url, lease)
        except RuntimeError:  # closing: the lease expires on its own
            pass

    def _release(self, url: str, lease: str) -> None:
        try:
            self.remote(url).delete_region(lease)
        except (EngineError, httpx.HTTPError) as exc:  # the lease expires on its own
            log.debug("kvferry: lease %s not deleted: %s", lease, exc)

    def _record(self, pull: Pull) -> None:
        r = pull.record
        entry = {"request_id": pull.spec.request_id, "wait_seconds": self.clock() - pull.started,
                 "transfer_seconds": r.get("seconds"), "answer_seconds": pull.answered - pull.started,
                 "load_seconds": pull.load_seconds, "blocks": len(pull.spec.local_blocks),
                 "bytes_raw": r.get("bytes_raw"), "bytes_wire": r.get("bytes_wire"), "ratio": r.get("ratio"),
                 "codec": r.get("chosen_codec"), "transfer_id": pull.transfer_id, "stages": r.get("stages")}
        self.stats.append(entry)
        del self.stats[:-1000]
        log.info("kvferry: request %s KV in after %.1f ms (%s blocks, %s, ratio %s)", entry["request_id"],
                 entry["wait_seconds"] * 1e3, entry["blocks"], entry["codec"], entry["ratio"])
        if self.config.stats_path:
            with open(self.config.stats_path, "a") as out:
                out.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        for client in list(self._clients.values()):
            client.close()

