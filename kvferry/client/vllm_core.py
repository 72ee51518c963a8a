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
  view of the same memory, leased (``PUT /v1/leases/{name}``) for ``lease_seconds`` and at most
  ``lease_ttl``. Its name goes back to vLLM in ``kv_transfer_params``; vLLM keeps the blocks until
  the producer reports the request sent: once the lease region is gone (the decode deleted it
  after its pull, the sidecar expired it, or an abort deleted it), which a long-poll of the
  sidecar's lease book tells. The sidecar never expires a region a transfer reads, so blocks are
  never stranded and a late pull can never read reused blocks: it finds no region.
* Decode scheduler (``Heartbeats``): while a request waits in vLLM's queue, its leases are renewed.
* Decode (``Consumer``): once vLLM has allocated blocks for a request, a worker thread checks the
  prefill (compatibility record, block layout: first contact), asks the *prefill's* sidecar to
  send the lease's blocks to its own sidecar's region (one transfer, pull semantics over
  kvferry's push API) in one HTTP call that answers at the transfer's end; the next step copies
  the pages into vLLM's cache, deletes the lease and reports the request received; a failure is
  reported as such, so vLLM's ``kv_load_failure_policy`` (fail or recompute) applies.

No HTTP call runs in vLLM's step: the step copies pages and collects what the threads found.
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
LEASE_GRACE = 5.0  # seconds a decode asks again for a lease the prefill may not have taken yet


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
    lease_seconds: float = 30.0  # a lease neither pulled nor renewed ends after this (the decode renews it)
    lease_ttl: float = 480.0  # ... and after this at the latest, renewed or not
    heartbeat_seconds: float = 0.0  # decode: renew waiting requests' leases this often (0: lease_seconds / 3)
    load_timeout: float = 30.0  # a decode fails a pull that is not done by then
    call_timeout: float = 10.0  # one control-API call of the connector's threads
    watch_seconds: float = 10.0  # prefill: one long-poll of the sidecar's leases waits at most this
    region: str = "vllm-kv"  # region name prefix
    stats_path: str = ""  # decode: append one JSON line per received request (wait, bytes, ratio)
    shm_prefix: str = "kvferry-"  # the local sidecar's shm_prefix setting (CPU mirrors are named so)
    in_place: bool = True  # GPU: lend vLLM's own cache where its layers lie end to end, else a mirror

    # KVFERRY_TOKEN and KVFERRY_SHM_PREFIX mean what they mean to the sidecar; the connector's own
    # settings are KVFERRY_CONNECTOR_* (a sidecar refuses KVFERRY_* names it does not know).
    ENV = {"url": "KVFERRY_CONNECTOR_URL", "token": "KVFERRY_TOKEN", "remote_token": "KVFERRY_CONNECTOR_REMOTE_TOKEN",
           "advertise_url": "KVFERRY_CONNECTOR_ADVERTISE_URL", "codec": "KVFERRY_CONNECTOR_CODEC",
           "lease_seconds": "KVFERRY_CONNECTOR_LEASE_SECONDS", "lease_ttl": "KVFERRY_CONNECTOR_LEASE_TTL",
           "heartbeat_seconds": "KVFERRY_CONNECTOR_HEARTBEAT_SECONDS", "load_timeout": "KVFERRY_CONNECTOR_LOAD_TIMEOUT",
           "call_timeout": "KVFERRY_CONNECTOR_CALL_TIMEOUT", "watch_seconds": "KVFERRY_CONNECTOR_WATCH_SECONDS",
           "region": "KVFERRY_CONNECTOR_REGION",
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
        for name in FLOATS:
            if name in values:
                values[name] = float(values[name])
                if not math.isfinite(values[name]) or values[name] < 0 or (values[name] == 0 and name != "heartbeat_seconds"):
                    raise ValueError(f"{name}: {values[name]!r} is not a positive number of seconds")
        if isinstance(values.get("in_place"), str):
            flag = values["in_place"].strip().lower()
            if flag not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"in_place: {values['in_place']!r} is not true or false")
            values["in_place"] = flag in ("1", "true", "yes")
        return cls(**values)

    @property
    def heartbeat(self) -> float:
        """Seconds between a decode's lease renewals: three per lease by default."""
        return self.heartbeat_seconds or self.lease_seconds / 3

    @property
    def public_url(self) -> str:
        return self.advertise_url or self.url

    def peer_token(self) -> str:
        return self.token if self.remote_token is None else self.remote_token


FLOATS = ("lease_seconds", "lease_ttl", "heartbeat_seconds", "load_timeout", "call_timeout", "watch_seconds")


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


# ---- compatibility -----------------------------------------------------------------------------
class IncompatiblePeer(IncompatibleCache):
    """The prefill and this decode disagree on something a transfer relies on (kvferry or peer
    protocol version, model, dtype, block size, layout, parallel shape)."""


COMPARED = ("kvferry", "peer_protocol", "model", "dtype", "kv_cache_dtype", "block_size", "tp", "pp")


def compat_record(model: str = "", dtype: str = "", kv_cache_dtype: str = "", block_size: int = 0,
                  tp: int = 1, pp: int = 1, dp: int = 1) -> dict[str, Any]:
    """What both sides of a transfer must agree on, sent by the prefill in ``kv_transfer_params``
    and checked by the decode before each pull (a dict comparison, no call). The block layout
    (shape, dtype, in place or a mirror) is checked against the prefill's region at first contact
    (``CacheLayout.check_peer``). ``dp`` is carried for the message only: each data-parallel rank
    is an engine of its own, with leases of its own. The sidecars' own handshake checks their wire
    protocol."""
    from kvferry import __version__
    from kvferry.engine import peer  # not kvferry.transport: vLLM's environment lacks its dependencies

    return {"kvferry": __version__, "peer_protocol": peer.VERSION,
            "model": str(model), "dtype": str(dtype), "kv_cache_dtype": str(kv_cache_dtype),
            "block_size": int(block_size), "tp": int(tp), "pp": int(pp), "dp": int(dp)}


def check_compat(ours: Mapping[str, Any], theirs: Mapping[str, Any] | None, where: str) -> None:
    """Raises: IncompatiblePeer naming every field that differs."""
    if theirs is None:
        raise IncompatiblePeer(f"the prefill at {where} sent no compatibility record: its kvferry connector is older "
                               f"than this decode's ({ours.get('kvferry')})")
    differ = [f"{key}: prefill {theirs.get(key)!r}, decode {ours.get(key)!r}" for key in COMPARED
              if theirs.get(key) != ours.get(key)]
    if differ:
        raise IncompatiblePeer(f"the prefill at {where} cannot hand this decode its KV; they differ in "
                               f"{'; '.join(differ)}")


# ---- statistics --------------------------------------------------------------------------------
FAILURE_KINDS = ("incompatible", "lease_gone", "unreachable", "timeout", "transfer", "integrity", "copy")


def failure_kind(error: BaseException | str) -> str:
    """A failed pull's kind, for counting (``kvferry_failures_total{kind=...}``)."""
    text = str(error)
    if isinstance(error, IncompatibleCache) or "IncompatibleCache" in text or "IncompatiblePeer" in text:
        return "incompatible"
    if isinstance(error, NotFound) or "NotFound" in text:
        return "lease_gone"
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)) or "ConnectError" in text:
        return "unreachable"
    if isinstance(error, httpx.TimeoutException) or "not done after" in text or "Timeout" in text:
        return "timeout"
    if "integrity" in text.lower() or "checksum" in text.lower() or "crc" in text.lower():
        return "integrity"
    if "copying the pages" in text:
        return "copy"
    return "transfer"


class TransferStats:
    """The connector's statistics of one interval: per received request its transfer time, bytes
    raw and on the wire and codec; failures by kind. Plain lists and counts (vLLM sends them from
    the workers to its logger process); ``kvferry.vllm.KvferryStats`` is this as vLLM's class."""

    def __init__(self, data: Mapping[str, Any] | None = None):
        self.reset()
        for key, value in (data or {}).items():  # copied: aggregating must not change the caller's lists
            if key in self.data:
                self.data[key] = dict(value) if key == "failures" else list(value)

    def reset(self) -> None:
        self.data = {"transfer_seconds": [], "wait_seconds": [], "bytes_raw": [], "bytes_wire": [], "codec": [],
                     "failures": {}}

    def record(self, entry: Mapping[str, Any]) -> None:
        d = self.data
        d["transfer_seconds"].append(float(entry.get("transfer_seconds") or 0.0))
        d["wait_seconds"].append(float(entry.get("wait_seconds") or 0.0))
        d["bytes_raw"].append(int(entry.get("bytes_raw") or 0))
        d["bytes_wire"].append(int(entry.get("bytes_wire") or 0))
        d["codec"].append(str(entry.get("codec") or "unknown"))

    def fail(self, kind: str) -> None:
        self.data["failures"][kind] = self.data["failures"].get(kind, 0) + 1

    def aggregate(self, other: TransferStats) -> TransferStats:
        for key in ("transfer_seconds", "wait_seconds", "bytes_raw", "bytes_wire", "codec"):
            self.data[key].extend(other.data.get(key, ()))
        for kind, n in other.data.get("failures", {}).items():
            self.data["failures"][kind] = self.data["failures"].get(kind, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n, raw, wire = len(d["transfer_seconds"]), sum(d["bytes_raw"]), sum(d["bytes_wire"])
        times = sorted(d["transfer_seconds"])
        return {"requests": n, "failures": sum(d["failures"].values()),
                "avg_transfer_ms": round(1e3 * sum(times) / n, 3) if n else 0.0,
                "p90_transfer_ms": round(1e3 * times[min(n - 1, int(0.9 * n))], 3) if n else 0.0,
                "avg_wait_ms": round(1e3 * sum(d["wait_seconds"]) / n, 3) if n else 0.0,
                "bytes_raw": raw, "bytes_wire": wire, "ratio": round(raw / wire, 3) if wire else 0.0}

    def is_empty(self) -> bool:
        return not self.data["transfer_seconds"] and not self.data["failures"]

    def take(self) -> TransferStats | None:
        """This interval's statistics (None if nothing happened), and a fresh interval."""
        if self.is_empty():
            return None
        taken = type(self)(self.data)
        self.reset()
        return taken


class PromMetrics:
    """The statistics as Prometheus metrics, registered through the metric classes vLLM hands a
    connector (``build_prom_metrics``), one child per engine."""

    def __init__(self, metric_types: Mapping[type, Any], labelnames: Sequence[str],
                 per_engine_labelvalues: Mapping[int, Sequence[object]]):
        from prometheus_client import Counter, Histogram

        histogram, counter = metric_types[Histogram], metric_types[Counter]
        self.labelnames, self.per_engine = list(labelnames), dict(per_engine_labelvalues)
        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self.transfer = histogram(name="vllm:kvferry_transfer_seconds", buckets=seconds, labelnames=self.labelnames,
                                  documentation="A request's KV transfer, as the prefill's sidecar timed it.")
        self.wait = histogram(name="vllm:kvferry_wait_seconds", buckets=seconds, labelnames=self.labelnames,
                              documentation="A request's pull from its start to its KV in vLLM's cache.")
        self.raw = counter(name="vllm:kvferry_bytes_raw", labelnames=[*self.labelnames, "codec"],
                           documentation="KV bytes received, uncompressed.")
        self.wire = counter(name="vllm:kvferry_bytes_wire", labelnames=[*self.labelnames, "codec"],
                            documentation="KV bytes received as they crossed the wire.")
        self.requests = counter(name="vllm:kvferry_requests", labelnames=[*self.labelnames, "codec"],
                                documentation="Requests whose KV was received, by the codec that carried it.")
        self.failures = counter(name="vllm:kvferry_failures", labelnames=[*self.labelnames, "kind"],
                                documentation="Pulls that failed, by kind (" + ", ".join(FAILURE_KINDS) + ").")
        self.ratio = histogram(name="vllm:kvferry_ratio", labelnames=[*self.labelnames, "codec"],
                               buckets=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0],
                               documentation="A request's compression ratio (raw bytes / wire bytes).")

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        values = list(self.per_engine.get(engine_idx, ()))
        for seconds, wait, raw, wire, codec in zip(data.get("transfer_seconds", ()), data.get("wait_seconds", ()),
                                                   data.get("bytes_raw", ()), data.get("bytes_wire", ()),
                                                   data.get("codec", ())):
            self.transfer.labels(*values).observe(seconds)
            self.wait.labels(*values).observe(wait)
            self.raw.labels(*values, codec).inc(raw)
            self.wire.labels(*values, codec).inc(wire)
            self.requests.labels(*values, codec).inc()
            if wire:
                self.ratio.labels(*values, codec).observe(raw / wire)
        for kind, n in data.get("failures", {}).items():
            self.failures.labels(*values, kind).inc(n)


# ---- prefill ------------------------------------------------------------------------------------
@dataclass
class Lease:
    request_id: str
    region: str
    deadline: float  # the TTL, on this worker's clock: freed then whatever the sidecar says
    held: bool = True  # False once released (the decode took the blocks, the lease lapsed or was aborted)
    generation: int | None = None  # the sidecar's lease generation once taken (None: being taken)
    taken: float = 0.0


class Producer:
    """Prefill worker: saves finished prompts' blocks and leases them; learns when they may be freed.

    vLLM's step only copies pages and reads what the connector's threads found: taking and ending
    leases runs on one thread (in order), and one more long-polls the sidecar's lease book
    (``GET /v1/leases?after=G&wait=``), which answers once a lease was taken or ended, so a held
    lease costs one call per change, not a poll per step. The sidecar ends a lease that was neither
    pulled nor renewed (``lease_seconds``, renewed by the decode's heartbeats) and at the latest
    ``lease_ttl`` after it was taken. A sidecar that stopped answering (it runs beside this worker:
    gone, and its regions with it) for ``lease_seconds`` frees the leases older than that."""

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic):
        import threading

        self.config, self.cache, self.rank, self.clock = config, cache, rank, clock
        self.leases: dict[str, Lease] = {}
        self._finished: set[str] = set()  # ids vLLM said finished (only those may be reported sent)
        self._lock = threading.Lock()
        self._client = Client(config.url, token=config.token, timeout=config.call_timeout)
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-lease")
        self._wake, self._closed = threading.Event(), threading.Event()
        self._silent_since: float | None = None  # the local sidecar has not answered the watcher since
        self._watcher = threading.Thread(target=self._watch, name="kvferry-lease-watch", daemon=True)
        self._watcher.start()

    def save(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        """Copy the request's blocks into the mirror (here, in vLLM's step) and lease them (on the
        lease thread). A lease that cannot be taken (sidecar down) is released: the blocks go back
        to vLLM and the decode's pull fails."""
        name = f"{lease_name(self.config.region, request_id)}-r{self.rank}"
        now = self.clock()
        lease = Lease(request_id, name, now + self.config.lease_ttl + self.config.call_timeout, taken=now)
        with self._lock:
            self.leases[request_id] = lease
        try:
            self.cache.save(block_ids)
        except Exception as exc:  # noqa: BLE001 (a copy failure is this request's failure)
            log.error("kvferry: cannot copy the KV of request %s (%s); the decode will not get it", request_id, exc)
            lease.held = False
            return lease
        self._submit(self._take, lease)
        return lease

    def abandon(self, request_ids: Iterable[str]) -> None:
        """vLLM aborted these requests: end their leases now (a pull reading one is cancelled)."""
        for request_id in request_ids:
            with self._lock:
                lease = self.leases.get(request_id)
                self._finished.add(request_id)
            if lease is not None and lease.held:
                self._submit(self._drop, lease)

    def finished_sending(self, finished_request_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks vLLM may free now (called every step; asks nobody)."""
        now = self.clock()
        with self._lock:
            self._finished.update(finished_request_ids)
            gone = self._silent_since is not None and now - self._silent_since >= self.config.lease_seconds
            for lease in self.leases.values():
                if lease.held and (now >= lease.deadline or (gone and now - lease.taken >= self.config.lease_seconds)):
                    log.warning("kvferry: lease %s unconfirmed (%s); freeing its blocks", lease.region,
                                "the local sidecar does not answer" if gone else "past its TTL")
                    lease.held = False
            done = {rid for rid, lease in self.leases.items() if not lease.held and rid in self._finished}
            for rid in done:
                del self.leases[rid]
                self._finished.discard(rid)
        return done

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _submit(self, work, lease: Lease) -> None:
        try:
            self._calls.submit(work, lease)
        except RuntimeError:  # closing
            lease.held = False

    def _take(self, lease: Lease) -> None:
        try:
            self.cache.alias(lease.region)
            answer = self._client.lease(lease.region, self.config.lease_seconds, ttl=self.config.lease_ttl)
        except Exception as exc:  # noqa: BLE001 (on the lease thread: any failure frees the blocks now, logged)
            log.error("kvferry: cannot lease the KV of request %s (%s); the decode will not get it",
                      lease.request_id, exc)
            self._delete(lease.region, force=True)
            lease.held = False
            return
        lease.generation = int(answer["generation"])
        self._wake.set()

    def _drop(self, lease: Lease) -> None:
        """Delete the lease region now, cancelling a pull that reads it."""
        self._delete(lease.region, force=True)
        lease.held = False
        log.info("kvferry: lease of request %s ended by an abort", lease.request_id)

    def _delete(self, region: str, force: bool) -> None:
        from kvferry.engine.errors import Conflict

        try:
            try:
                self._client.delete_region(region)
            except Conflict:
                if not force:
                    raise
                for record in self._client.region(region).get("busy_transfers", []):
                    self._client.cancel(record)
                self._client.delete_region(region, force=True)
        except NotFound:
            pass
        except (EngineError, httpx.HTTPError) as exc:
            log.warning("kvferry: lease %s could not be deleted (%s); the sidecar expires it", region, exc)

    def _watch(self) -> None:
        """Long-poll the sidecar's lease book; mark leases that ended as not held."""
        generation, failing = -1, 0
        while not self._closed.is_set():
            with self._lock:
                waiting = [lease for lease in self.leases.values() if lease.held]
            if not waiting:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                book = self._client.leases(after=generation, wait=self.config.watch_seconds)
            except (EngineError, httpx.HTTPError) as exc:
                failing += 1
                if failing == 1:
                    self._silent_since = self.clock()
                    log.warning("kvferry: cannot watch the sidecar's leases: %s", exc)
                self._closed.wait(min(5.0, 0.1 * 2 ** failing))
                continue
            failing, self._silent_since = 0, None
            generation, present = int(book["generation"]), book["leases"]
            for lease in waiting:
                if lease.generation is not None and lease.generation <= generation and lease.region not in present:
                    lease.held = False  # pulled and deleted by the decode, expired, or deleted by an abort


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
    kind: str = ""  # the failure's kind (FAILURE_KINDS)
    record: dict[str, Any] = field(default_factory=dict)
    ended: Future | None = None  # the whole pull on a worker thread: the transfer's record at its end
    answered: float = 0.0  # when that thread had the record (the consumer's clock)
    asked_wall: float = 0.0  # wall clock when the pull was sent and answered: lined up with the
    answered_wall: float = 0.0  # sidecar's record (``created``) where both run on one host
    load_seconds: float = 0.0  # copying the pages into vLLM's cache


def remote_params(request_id: str, block_ids: Sequence[int], config: ConnectorConfig,
                  num_tokens: int = 0, compat: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a prefill hands the decode (inside vLLM's kv_transfer_params)."""
    params = {"url": config.public_url, "lease": lease_name(config.region, request_id),
              "block_ids": [int(b) for b in block_ids], "num_tokens": int(num_tokens)}
    if compat is not None:
        params["compat"] = dict(compat)
        params["ranks"] = int(compat.get("tp", 1))
    return params


def lease_names(params: Mapping[str, Any]) -> list[str]:
    """Every worker's lease of a request (``kv_transfer_params``): one per tensor-parallel rank."""
    return [f"{params['lease']}-r{rank}" for rank in range(int(params.get("ranks", 1)))]


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
    """Decode worker: pulls each request's KV from its prefill's sidecar into the local cache.

    vLLM's step makes no HTTP call: ``start`` hands the pull to a worker thread (the first contact
    with a prefill's sidecar, its checks, the transfer's submission and its long-polled end),
    ``poll`` collects the ends at the next steps and copies the pages."""

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic,
                 compat: Mapping[str, Any] | None = None):
        import threading

        self.config, self.cache, self.rank, self.clock = config, cache, rank, clock
        self.compat = dict(compat) if compat is not None else None
        self.pulls: dict[str, Pull] = {}
        self.failed_blocks: dict[str, tuple[int, ...]] = {}  # request id -> its blocks that did not load
        self._clients: dict[str, Client] = {}
        self._checked: dict[str, int] = {}  # prefill sidecars whose layout matched ours -> their vLLM blocks
        self._data_address: str | None = None
        self._local = Client(config.url, token=config.token, timeout=config.call_timeout)
        self._lock = threading.Lock()
        self.stats: list[dict[str, Any]] = []
        self.interval = TransferStats()  # what vLLM's get_kv_connector_stats takes
        self._waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="kvferry-pull")

    def remote(self, url: str) -> Client:
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = Client(url, token=self.config.peer_token(),
                                                     timeout=self.config.call_timeout)
            return client

    def start(self, spec: LoadSpec) -> Pull:
        """Hand the pull to a worker thread; never raises, never waits (a failure is reported as a
        failed load by ``poll``). A spec without local blocks only ends the prefill's lease."""
        pull = Pull(spec, self.clock())
        if not spec.local_blocks:
            self._release_later(pull)
            return pull
        self.pulls[spec.request_id] = pull
        try:
            pull.ended = self._waiters.submit(self._run, pull)
        except RuntimeError as exc:  # closing
            pull.error, pull.kind = f"the connector is closing: {exc}", "transfer"
        return pull

    def _run(self, pull: Pull) -> dict[str, Any]:
        """On a worker thread: check the prefill (first contact), send the pull, long-poll its end
        (at most ``LONG_POLL`` seconds a call) until it ended or ``load_timeout`` passed."""
        deadline = time.monotonic() + self.config.load_timeout
        spec = pull.spec
        url, lease = spec.params["url"], self._lease(spec)
        if self.compat is not None:
            check_compat(self.compat, spec.params.get("compat"), url)
        src, dst = match_blocks(spec.local_blocks, spec.params["block_ids"])
        pull.client = self.remote(url)
        # The prefill takes the lease on a thread of its own, so a pull may come a moment before
        # it: a missing lease is asked for again for LEASE_GRACE seconds before the pull fails.
        grace, pause = time.monotonic() + min(LEASE_GRACE, self.config.load_timeout), 0.01
        while True:
            try:
                record = self._send(pull, url, lease, src, dst)
                break
            except NotFound:
                if time.monotonic() + pause > grace:
                    raise
                time.sleep(pause)
                pause = min(0.2, pause * 2)
        pull.transfer_id = record["id"]
        while record["state"] in ("queued", "running"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            record = pull.client.transfer(pull.transfer_id, wait=min(LONG_POLL, left))
        pull.answered, pull.answered_wall = self.clock(), time.time()
        return record

    def _send(self, pull: Pull, url: str, lease: str, src: list[int], dst: list[int]) -> dict[str, Any]:
        """Check the prefill's blocks (first contact) and send the pull; its record once answered."""
        if url not in self._checked:
            self._checked[url] = self.cache.layout.check_peer(pull.client.region(lease), url)
        layout = self.cache.layout
        src_blocks, dst_blocks = layout.blocks(src, self._checked[url]), layout.blocks(dst)
        if self._data_address is None:
            self._data_address = self._local.data_address()
        codec = pull.spec.params.get("codec") or self.config.codec  # a request may name its codec
        pull.asked_wall = time.time()
        answer = pull.client.send_later(lease, src_blocks, self._data_address, self.cache.name, dst_blocks,
                                        codec=codec, wait=min(LONG_POLL, self.config.load_timeout))
        return answer.result()

    def poll(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids, each reported once; received ones are in vLLM's cache.
        Asks nobody: a pull still on its way past ``load_timeout`` fails here, and its transfer is
        cancelled on a worker thread."""
        received, failed = set(), set()
        for rid, pull in list(self.pulls.items()):
            if pull.error is None and pull.ended is not None:
                timed_out = self.clock() - pull.started > self.config.load_timeout
                if not pull.ended.done():
                    if not timed_out:
                        continue  # still on its way
                    pull.error, pull.kind = f"pull not done after {self.config.load_timeout:g} s", "timeout"
                    self._cancel_later(pull)
                else:
                    self._ended(pull)
            del self.pulls[rid]
            if pull.error is None:
                received.add(rid)
                self._record(pull)
            else:
                failed.add(rid)
                self.failed_blocks[rid] = tuple(pull.spec.local_blocks)
                self.interval.fail(pull.kind or failure_kind(pull.error))
                log.error("kvferry: KV of request %s not loaded: %s", rid, pull.error)
            self._release_later(pull)
        return received, failed

    def _ended(self, pull: Pull) -> None:
        try:
            pull.record = pull.ended.result()
        except Exception as exc:  # noqa: BLE001 (whatever stopped the pull is this request's failure)
            pull.error, pull.kind = f"{type(exc).__name__}: {exc}", failure_kind(exc)
            return
        state = pull.record["state"]
        if state == "done":
            try:
                loading = self.clock()
                self.cache.load(self._local_blocks(pull))
                pull.load_seconds = self.clock() - loading
            except Exception as exc:  # noqa: BLE001 (a copy failure is this request's failure)
                pull.error, pull.kind = f"copying the pages into vLLM's cache failed: {exc}", "copy"
        elif state in ("failed", "cancelled"):
            pull.error = (f"transfer {pull.transfer_id} {state}: {pull.record.get('error_kind')}: "
                          f"{pull.record.get('error')}")
            pull.kind = failure_kind(pull.error)
        else:
            pull.error, pull.kind = f"transfer {pull.transfer_id} not done after {self.config.load_timeout:g} s", \
                "timeout"
            self._cancel_later(pull)

    def _cancel_later(self, pull: Pull) -> None:
        def cancel() -> None:
            try:
                if pull.ended is not None:
                    pull.ended.result(timeout=self.config.call_timeout)  # its transfer id, once sent
            except Exception:  # noqa: BLE001 (the pull failed anyway: nothing to cancel)
                pass
            if pull.transfer_id is not None and pull.client is not None:
                try:
                    pull.client.cancel(pull.transfer_id)
                except (EngineError, httpx.HTTPError):
                    pass  # it may have ended meanwhile; the request fails either way
        try:
            self._waiters.submit(cancel)
        except RuntimeError:
            pass

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
            self._waiters.submit(self._release, url, lease, pull.ended)
        except RuntimeError:  # closing: the lease expires on its own
            pass

    def _release(self, url: str, lease: str, ended: Future | None) -> None:
        if ended is not None:  # a pull that timed out may still be submitting: release after it
            try:
                ended.result(timeout=self.config.call_timeout + self.config.load_timeout)
            except Exception:  # noqa: BLE001
                pass
        grace, pause = time.monotonic() + LEASE_GRACE, 0.01
        while True:
            try:
                self.remote(url).delete_region(lease)
                return
            except NotFound:  # pulled and ended already, or not taken yet: ask again for a moment
                if time.monotonic() + pause > grace:
                    return
                time.sleep(pause)
                pause = min(0.2, pause * 2)
            except (EngineError, httpx.HTTPError) as exc:  # the lease expires on its own
                log.debug("kvferry: lease %s not deleted: %s", lease, exc)
                return

    def _record(self, pull: Pull) -> None:
        r = pull.record
        entry = {"request_id": pull.spec.request_id, "wait_seconds": self.clock() - pull.started,
                 "transfer_seconds": r.get("seconds"), "answer_seconds": pull.answered - pull.started,
                 "load_seconds": pull.load_seconds, "blocks": len(pull.spec.local_blocks),
                 "bytes_raw": r.get("bytes_raw"), "bytes_wire": r.get("bytes_wire"), "ratio": r.get("ratio"),
                 "codec": r.get("chosen_codec"), "transfer_id": pull.transfer_id, "stages": r.get("stages")}
        self.stats.append(entry)
        del self.stats[:-1000]
        self.interval.record(entry)
        log.info("kvferry: request %s KV in after %.1f ms (%s blocks, %s, ratio %s)", entry["request_id"],
                 entry["wait_seconds"] * 1e3, entry["blocks"], entry["codec"], entry["ratio"])
        if self.config.stats_path:
            with open(self.config.stats_path, "a") as out:
                out.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        for client in [*self._clients.values(), self._local]:
            client.close()


class Heartbeats:
    """Decode scheduler: renews the prefill leases of requests waiting in vLLM's queue (every
    ``heartbeat_seconds``, one call per prefill sidecar), from the request's arrival until its pull
    starts or it is finished, so a queue longer than ``lease_seconds`` does not lose the KV."""

    def __init__(self, config: ConnectorConfig, clock=time.monotonic):
        import threading

        self.config, self.clock = config, clock
        self._tracked: dict[str, Mapping[str, Any]] = {}
        self._lock = threading.Lock()
        self._clients: dict[str, Client] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0  # heartbeat calls made (for the tests and the log)

    def track(self, request_id: str, params: Mapping[str, Any]) -> None:
        import threading

        with self._lock:
            self._tracked[request_id] = params
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="kvferry-heartbeat", daemon=True)
                self._thread.start()

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._tracked.pop(request_id, None)

    def close(self) -> None:
        self._closed.set()
        for client in list(self._clients.values()):
            client.close()

    def beat(self) -> None:
        """One round: renew every tracked request's leases, grouped by prefill sidecar."""
        with self._lock:
            tracked = list(self._tracked.items())
        by_url: dict[str, list[str]] = {}
        for _, params in tracked:
            try:
                by_url.setdefault(params["url"], []).extend(lease_names(params))
            except (KeyError, TypeError, ValueError):
                continue
        for url, names in by_url.items():
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = Client(url, token=self.config.peer_token(),
                                                     timeout=self.config.call_timeout)
            try:
                answer = client.renew_leases(names, self.config.lease_seconds)
                self.sent += 1
            except (EngineError, httpx.HTTPError) as exc:
                log.warning("kvferry: heartbeat to %s failed: %s", url, exc)
                continue
            if answer.get("missing"):
                log.warning("kvferry: the prefill at %s no longer holds leases %s: those requests' KV is gone",
                            url, answer["missing"][:4])

    def _beat(self) -> None:
        while not self._closed.wait(self.config.heartbeat):
            self.beat()
