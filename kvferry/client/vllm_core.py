"""The vLLM connector's core, free of vLLM imports: what the connector asks the sidecars, which
blocks go where, and the leases that keep a prefill's blocks alive until the decode has them.

The flow (one kvferry transfer per request, all layers and KV cache groups in it; where prefill
and decode run different tensor-parallel sizes, one per prefill rank a decode rank reads: the
heads it holds, ``kvferry.client.tp``):

* Every vLLM worker registers its KV cache with its local sidecar once (``KvCache``,
  ``vllm_cache.py``): on a GPU the sidecar maps the worker's own memory (``cuda_ipc``, no copy);
  on the CPU vLLM owns the allocation, so the cache is mirrored in a POSIX shared-memory segment,
  head-major (a region block per vLLM block and KV head, every layer's page of that head in it),
  and pages are copied in (prefill) or out (decode) per request.
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
  kvferry's push API; over gRPC where that sidecar serves it), and learns the transfer's end
  from its own sidecar, which wrote the KV (a long-poll, or a gRPC Watch of that transfer:
  ``vllm_watch.py``); the next step copies the pages into vLLM's cache, deletes the lease and
  reports the request received; a failure is reported as such, so vLLM's
  ``kv_load_failure_policy`` (fail or recompute) applies.

No HTTP call runs in vLLM's step: the step copies pages and collects what the threads found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ipaddress
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvferry.engine.errors import Conflict, EngineError, NotFound

from . import tp
from .sdk import Answer, Client
from .vllm_cache import DTYPES, FP8, GRANULE, CacheLayout, IncompatibleCache, KvCache, distinct
from .vllm_stats import FAILURE_KINDS, PromMetrics, TransferStats, failure_kind
from .vllm_watch import CONTROLS, Stream, Watches, overloaded

log = logging.getLogger("kvferry.vllm")

__all__ = ["DTYPES", "FP8", "FAILURE_KINDS", "MAX_RANKS", "CacheLayout", "ConnectorConfig", "Consumer", "Heartbeats",
           "IncompatibleCache", "IncompatiblePeer", "KvCache", "LoadSpec", "Producer", "PromMetrics", "RefusedPrefill",
           "TransferStats", "check_compat", "check_remote", "compat_record", "distinct", "failure_kind", "fresh_blocks",
           "lease_name", "lease_names", "match_blocks", "pair_groups", "remote_params"]

PARAMS_KEY = "kvferry"  # our part of vLLM's kv_transfer_params
WAITERS = 16  # a decode's pulls waited on at once (more wait for a thread)
LONG_POLL = 10.0  # seconds one long-poll of a transfer's end may take
# Seconds the decode's own sidecar is asked to wait for a pulled transfer's announce before the
# decode asks the prefill instead: a transfer refused before it was announced (the receiver
# overloaded) or still queued on the prefill is learned there. Long enough for a loaded host's
# announce, and for a same-host write of a CPU cache, which is announced behind its data.
APPEAR = 1.0
# Seconds a decode asks again for a lease the prefill may not have taken yet (its lease thread can
# lag seconds behind vLLM's step on a loaded host: 5 s failed one request in sixty on 2 cores).
LEASE_GRACE = 15.0
# Seconds a decode's release waits for a lease to appear before leaving it to expire on its own
# (most often it was pulled and ended already; asking longer only adds calls to the prefill's sidecar).
RELEASE_GRACE = 5.0
# Seconds a pull whose transfer this decode's own sidecar failed (or cancelled) waits for the
# prefill's record of it to end too, for the failure in the sender's words. A sender stalled in
# its own work hears of it late; the pull then fails with the receiver's words, not a timeout.
SENDER_WORD = 1.0
# Prefill tensor-parallel ranks a request may name (one lease each): far beyond any size vLLM runs.
MAX_RANKS = 1024


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
    control: str = "auto"  # decode: transfer ends by a prefill's gRPC Watch where it serves one, or "http" only
    prefill_urls: tuple[str, ...] = ()  # decode: the prefill sidecars it may call (and send remote_token to)

    # KVFERRY_TOKEN and KVFERRY_SHM_PREFIX mean what they mean to the sidecar; the connector's own
    # settings are KVFERRY_CONNECTOR_* (a sidecar refuses KVFERRY_* names it does not know).
    ENV = {"url": "KVFERRY_CONNECTOR_URL", "token": "KVFERRY_TOKEN", "remote_token": "KVFERRY_CONNECTOR_REMOTE_TOKEN",
           "advertise_url": "KVFERRY_CONNECTOR_ADVERTISE_URL", "codec": "KVFERRY_CONNECTOR_CODEC",
           "lease_seconds": "KVFERRY_CONNECTOR_LEASE_SECONDS", "lease_ttl": "KVFERRY_CONNECTOR_LEASE_TTL",
           "heartbeat_seconds": "KVFERRY_CONNECTOR_HEARTBEAT_SECONDS", "load_timeout": "KVFERRY_CONNECTOR_LOAD_TIMEOUT",
           "call_timeout": "KVFERRY_CONNECTOR_CALL_TIMEOUT", "watch_seconds": "KVFERRY_CONNECTOR_WATCH_SECONDS",
           "region": "KVFERRY_CONNECTOR_REGION",
           "stats_path": "KVFERRY_CONNECTOR_STATS_PATH", "shm_prefix": "KVFERRY_SHM_PREFIX",
           "in_place": "KVFERRY_CONNECTOR_IN_PLACE", "control": "KVFERRY_CONNECTOR_CONTROL",
           "prefill_urls": "KVFERRY_CONNECTOR_PREFILL_URLS"}

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
        if values.get("control", "auto") not in CONTROLS:
            raise ValueError(f"control: {values['control']!r} is not one of {', '.join(CONTROLS)}")
        if "prefill_urls" in values:
            values["prefill_urls"] = prefill_urls(values["prefill_urls"])
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

    def admits(self, url: str) -> bool:
        """Whether this decode may call the prefill sidecar at ``url`` (and send it its token):
        any where ``prefill_urls`` is empty, else one of them by scheme, host and port, or by an
        address inside one of its networks (pods come and go with new addresses)."""
        if not self.prefill_urls:
            return True
        target = origin(url)
        if target is None:
            return False
        for entry in self.prefill_urls:
            network = _network(entry)
            if network is None and origin(entry) == target:
                return True
            if network is not None and _inside(target[1], network):
                return True
        return False


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The network a ``prefill_urls`` entry names (``10.0.0.0/8``), or None for a URL."""
    if "/" not in entry or "://" in entry:
        return None
    try:
        return ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None


def _inside(host: str, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")) in network
    except ValueError:  # a name: only a URL entry names it
        return False


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an HTTP URL, the port filled in; None where it names none."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except (AttributeError, ValueError):
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or port is None:
        return None
    return parts.scheme.lower(), parts.hostname.lower(), port


def prefill_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """The ``prefill_urls`` setting: a list, or one string apart by commas or spaces, of http(s)
    URLs and of networks (``10.0.0.0/8``: any sidecar at an address inside it).

    Raises: ValueError for an entry that is neither."""
    entries = value.replace(",", " ").split() if isinstance(value, str) else [str(v).strip() for v in value]
    for entry in entries:
        if origin(entry) is None and _network(entry) is None:
            raise ValueError(f"prefill_urls: {entry!r} is neither an http(s) URL with a host nor a network")
    return tuple(entries)


FLOATS = ("lease_seconds", "lease_ttl", "heartbeat_seconds", "load_timeout", "call_timeout", "watch_seconds")


def lease_name(prefix: str, request_id: str, dp_rank: int = 0) -> str:
    """The lease of a prefill request: a valid region name whatever the request id holds, the
    same in vLLM's scheduler and worker processes. Worker ``rank`` holds ``f"{lease}-r{rank}"``.
    A data-parallel rank other than 0 is part of the name, so DP ranks sharing a sidecar never
    collide (request ids are only unique within one engine)."""
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:24]
    return f"{prefix}-lease-{digest}" if not dp_rank else f"{prefix}-lease-dp{int(dp_rank)}-{digest}"


# ---- compatibility -----------------------------------------------------------------------------
class IncompatiblePeer(IncompatibleCache):
    """The prefill and this decode disagree on something a transfer relies on (kvferry or peer
    protocol version, model, dtype, block size, layout, parallel shape)."""


COMPARED = ("kvferry", "peer_protocol", "model", "dtype", "kv_cache_dtype", "kv_heads", "head_size",
            "layers", "layout", "groups", "pp")


def compat_record(model: str = "", dtype: str = "", kv_cache_dtype: str = "", block_size: int = 0,
                  tp: int = 1, pp: int = 1, dp: int = 1, kv_heads: int = 0, head_size: int = 0, layers: int = 0,
                  layout: str = "", groups: Sequence[str] = ()) -> dict[str, Any]:
    """What both sides of a transfer must agree on, sent by the prefill in ``kv_transfer_params``
    and checked by the decode before each pull (a dict comparison, no call). ``kv_heads``: the
    model's KV heads in all (1 for MLA, whose latent every rank holds whole); ``layout``: vLLM's
    KV cache layout name (and ``mla``); ``groups``: its KV cache groups (``full``,
    ``sliding_window:64``). Tensor-parallel sizes may differ where both split the heads, and
    block sizes where both are multiples of a mirror's granule (``check_compat``); ``dp`` only
    rides along: each data-parallel rank is an engine of its own, with leases of its own. The
    block layout (shape, dtype, in place or a mirror) is checked against the prefill's region at
    first contact (``CacheLayout.check_peer``); the sidecars' own handshake checks their wire
    protocol."""
    from kvferry import __version__
    from kvferry.engine import peer  # not kvferry.transport: vLLM's environment lacks its dependencies

    return {"kvferry": __version__, "peer_protocol": peer.VERSION,
            "model": str(model), "dtype": str(dtype), "kv_cache_dtype": str(kv_cache_dtype),
            "block_size": int(block_size), "tp": int(tp), "pp": int(pp), "dp": int(dp), "kv_heads": int(kv_heads),
            "head_size": int(head_size), "layers": int(layers), "layout": str(layout), "groups": list(groups)}


def check_compat(ours: Mapping[str, Any], theirs: Mapping[str, Any] | None, where: str) -> None:
    """Raises: IncompatiblePeer naming every field that differs, and tensor-parallel sizes that
    cannot exchange heads (``kvferry.client.tp``)."""
    if theirs is None:
        raise IncompatiblePeer(f"the prefill at {where} sent no compatibility record: its kvferry connector is older "
                               f"than this decode's ({ours.get('kvferry')})")
    differ = [f"{key}: prefill {theirs.get(key)!r}, decode {ours.get(key)!r}" for key in COMPARED
              if theirs.get(key) != ours.get(key)]
    sizes = int(theirs.get("block_size") or 0), int(ours.get("block_size") or 0)
    if sizes[0] != sizes[1] and (not all(sizes) or any(n % GRANULE for n in sizes)):
        differ.append(f"block_size: prefill {sizes[0]}, decode {sizes[1]} (different block sizes are exchanged "
                      f"in pieces of {GRANULE} tokens: both must be multiples of it)")
    p_tp, d_tp = int(theirs.get("tp", 1)), int(ours.get("tp", 1))
    if p_tp != d_tp:
        heads = int(ours.get("kv_heads") or 0)
        try:
            if heads < 1:
                raise tp.BadShape("the KV head count is unknown")
            tp.plan(heads, p_tp, d_tp, 0)
            tp.rank_heads(heads, p_tp, 0)
        except tp.BadShape as exc:
            differ.append(f"tp: prefill {p_tp}, decode {d_tp} ({exc})")
    if differ:
        raise IncompatiblePeer(f"the prefill at {where} cannot hand this decode its KV; they differ in "
                               f"{'; '.join(differ)}")


class RefusedPrefill(IncompatiblePeer):
    """A request's ``kv_transfer_params`` name a prefill this decode does not call: a sidecar
    ``prefill_urls`` does not list, or a shape no prefill sends (more ranks than its record says)."""


def check_remote(params: Any, config: ConnectorConfig) -> None:
    """Vet what a request names before any call: ``kv_transfer_params`` come with the request (from
    whoever sent it to the proxy), not from the prefill, and the decode sends its token where they
    point and makes one lease name per rank they count.

    Raises: RefusedPrefill."""
    if not isinstance(params, Mapping) or not isinstance(params.get("url"), str) \
            or not isinstance(params.get("lease"), str):
        raise RefusedPrefill("the request's kv_transfer_params name no prefill sidecar URL and lease")
    url = params["url"]
    if not config.admits(url):
        raise RefusedPrefill(f"the prefill sidecar {url!r} is not among this decode's prefill_urls")
    try:
        ranks = int(params.get("ranks", 1))
        compat = params.get("compat")
        size = ranks if compat is None else int(compat.get("tp", 1))
    except (AttributeError, TypeError, ValueError) as exc:
        raise RefusedPrefill(f"the request's kv_transfer_params count no ranks ({exc})") from None
    if not 1 <= ranks <= MAX_RANKS or ranks != size:
        raise RefusedPrefill(f"the request names {ranks} ranks of the prefill at {url}, whose record says "
                             f"tensor-parallel size {size} (at most {MAX_RANKS})")


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

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic,
                 dp_rank: int = 0):
        self.config, self.cache, self.rank, self.clock, self.dp_rank = config, cache, rank, clock, dp_rank
        self.leases: dict[str, Lease] = {}
        self._finished: set[str] = set()  # ids vLLM said finished (only those may be reported sent)
        self._lock = threading.Lock()
        self._client = Client(config.url, token=config.token, timeout=config.call_timeout)
        # the watcher's long-poll holds a connection of its own, so the lease calls' stays idle for the step
        self._book = Client(config.url, token=config.token, timeout=config.call_timeout)
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-lease")
        self._wake, self._closed = threading.Event(), threading.Event()
        self._silent_since: float | None = None  # the local sidecar has not answered the watcher since
        self._watcher = threading.Thread(target=self._watch, name="kvferry-lease-watch", daemon=True)
        self._watcher.start()

    def save(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        """Copy the request's blocks into the mirror (here, in vLLM's step) and lease them: the
        request written here where it cannot wait (on a connection already open, as a decode's
        pull is: a lease thread held off by a busy step would keep the decode's pull waiting), its
        answer read on the lease thread, which asks itself otherwise. A lease that cannot be taken
        (sidecar down) is released: the blocks go back to vLLM and the decode's pull fails."""
        name = f"{lease_name(self.config.region, request_id, self.dp_rank)}-r{self.rank}"
        now = self.clock()
        lease = Lease(request_id, name, now + self.config.lease_ttl + self.config.call_timeout, taken=now)
        with self._lock:
            self.leases[request_id] = lease
        try:
            self.cache.save(flat_blocks(block_ids))
        except Exception as exc:  # noqa: BLE001 (a copy failure is this request's failure)
            log.error("kvferry: cannot copy the KV of request %s (%s); the decode will not get it", request_id, exc)
            lease.held = False
            return lease
        self._submit(self._take, lease, self._lease_early(lease.region))
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
        self._book.close()

    def _submit(self, work, lease: Lease, *args: Any) -> None:
        try:
            self._calls.submit(work, lease, *args)
        except RuntimeError:  # closing
            lease.held = False

    def _lease_early(self, region: str) -> Answer | None:
        """The lease of ``region`` asked for now, on a connection already open; None (nothing
        sent) where there is none. Never raises."""
        try:
            return self._client.lease_later(region, self.config.lease_seconds, ttl=self.config.lease_ttl,
                                            of=self.cache.name, warm_only=True)
        except Exception:  # noqa: BLE001 (the lease thread asks)
            return None

    def _take(self, lease: Lease, early: Answer | None = None) -> None:
        try:
            answer = self._lease(lease.region, early)
        except Exception as exc:  # noqa: BLE001 (on the lease thread: any failure frees the blocks now, logged)
            log.error("kvferry: cannot lease the KV of request %s (%s); the decode will not get it",
                      lease.request_id, exc)
            self._delete(lease.region, force=True)
            lease.held = False
            return
        lease.generation = int(answer["generation"])
        self._wake.set()

    def _lease(self, region: str, early: Answer | None = None) -> dict[str, Any]:
        """Lease a view of the registered cache named ``region``: one call (``early``'s, where
        it was asked already), nothing mapped again."""
        seconds, ttl = self.config.lease_seconds, self.config.lease_ttl
        try:
            if early is not None:
                return early.result()
            return self._client.lease(region, seconds, ttl=ttl, of=self.cache.name)
        except NotFound:  # a sidecar without views, or one that lost the cache's registration
            self.cache.alias(region)
            return self._client.lease(region, seconds, ttl=ttl)

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
        """Long-poll the sidecar's lease book; mark leases that ended as not held.

        A lease the book lacks has ended if it was taken before the book was asked for (whatever the
        generations say: a restarted sidecar's book starts again near 0, its regions gone), or by
        the book's generation. After a failed call the next one asks for the book at once."""
        generation, after, failing = -1, -1, 0
        while not self._closed.is_set():
            with self._lock:
                waiting = [(lease, lease.generation is not None) for lease in self.leases.values() if lease.held]
            if not waiting:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                book = self._book.leases(after=after, wait=self.config.watch_seconds)
            except (EngineError, httpx.HTTPError) as exc:
                if self._closed.is_set():
                    return  # closed under the read
                failing, after = failing + 1, -1
                if failing == 1:
                    self._silent_since = self.clock()
                    log.warning("kvferry: cannot watch the sidecar's leases: %s", exc)
                self._closed.wait(min(5.0, 0.1 * 2 ** failing))
                continue
            failing, self._silent_since = 0, None
            seen, present = int(book["generation"]), book["leases"]
            backwards, generation = seen < generation, seen
            after = generation
            if backwards:
                log.warning("kvferry: the sidecar's lease book started again (generation %d): a restart", seen)
            for lease, taken in waiting:
                if lease.region in present or lease.generation is None:
                    continue
                if taken or (not backwards and lease.generation <= generation):
                    lease.held = False  # pulled and deleted by the decode, expired, deleted by an abort, or lost


# ---- decode -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """One request's pull: what the scheduler hands the worker."""

    request_id: str
    local_blocks: tuple[int, ...]
    params: Mapping[str, Any]  # our part of the prefill's kv_transfer_params
    tokens: int = 0  # the prompt's length (0: as the prefill counted it): the blocks read hold these
    starts: tuple[int, ...] = ()  # per group, the prompt block the first local block holds (``fresh_blocks``)


@dataclass
class Pull:
    spec: LoadSpec
    started: float
    client: Client | None = None
    transfer_id: str | None = None  # the first of transfer_ids
    transfer_ids: list[str] = field(default_factory=list)  # one per prefill rank read
    error: str | None = None
    kind: str = ""  # the failure's kind (FAILURE_KINDS)
    record: dict[str, Any] = field(default_factory=dict)
    ended: Future | None = None  # the whole pull on a worker thread: the transfer's record at its end
    answered: float = 0.0  # when that thread had the record (the consumer's clock)
    asked_wall: float = 0.0  # wall clock when the pull was sent and answered: lined up with the
    answered_wall: float = 0.0  # sidecar's record (``created``) where both run on one host
    load_seconds: float = 0.0  # copying the pages into vLLM's cache
    control: str = "http"  # how the transfers' ends came: "grpc" (each pushed by a Watch) or "http"
    pairs: Pairs | None = None  # what it reads and writes (``Consumer.pairs``), worked out once
    stopping: Future | None = None  # its transfers being cancelled: the failure is reported once it ends


@dataclass
class Early:
    """A pull sent from vLLM's step thread (``Consumer._send_early``), its answers read by the
    worker thread: ``answer`` the prefill's (the record once started), ``ending`` the ask for its
    end on this decode's own sidecar (as ``Consumer._watch_end`` returns it)."""

    transfer_id: str
    answer: Answer
    ending: tuple[Stream | None, Any] | None

    def cancel(self) -> None:
        self.answer.cancel()
        if self.ending is not None:
            self.ending[1].cancel()


def remote_params(request_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]], config: ConnectorConfig,
                  num_tokens: int = 0, compat: Mapping[str, Any] | None = None, dp_rank: int = 0) -> dict[str, Any]:
    """What a prefill hands the decode (inside vLLM's kv_transfer_params): ``block_ids`` one list,
    or one per KV cache group."""
    ids: list[Any] = [[int(b) for b in g] for g in block_ids] if block_ids and isinstance(
        block_ids[0], (list, tuple)) else [int(b) for b in block_ids]
    params = {"url": config.public_url, "lease": lease_name(config.region, request_id, dp_rank),
              "block_ids": ids, "num_tokens": int(num_tokens)}
    if compat is not None:
        params["compat"] = dict(compat)
        params["ranks"] = int(compat.get("tp", 1))
    return params


def lease_names(params: Mapping[str, Any], ranks: Iterable[int] | None = None) -> list[str]:
    """Worker leases of a request (``kv_transfer_params``): one per tensor-parallel rank, or
    those of ``ranks``."""
    ranks = range(int(params.get("ranks", 1))) if ranks is None else ranks
    return [f"{params['lease']}-r{rank}" for rank in ranks]


def match_blocks(local: Sequence[int], remote: Sequence[int], start: int | None = None,
                 count: int | None = None) -> tuple[list[int], list[int]]:
    """(prefill blocks, decode blocks): each of the decode's fresh blocks with the prefill's block
    of the same tokens. The prefill's list starts at the prompt's first block and may run past the
    prompt (a token it generated, lookahead slots); the decode's starts at prompt block ``start``
    (those before it came from its own prefix cache, or lie out of a sliding window). ``count``:
    the prompt's blocks, the last ones read. Without ``start`` the decode's blocks end at the
    prompt's last block, or, without ``count`` either, at the prefill's last.

    Raises: IncompatibleCache when the prefill holds fewer of the prompt's blocks than the decode needs.
    """
    local, remote = list(map(int, local)), list(map(int, remote))
    if start is None:
        start = (len(remote) if count is None else count) - len(local)
    n = len(local) if count is None else max(0, min(len(local), count - start))
    if start < 0 or start + n > len(remote):
        raise IncompatibleCache(f"the decode allocated {len(local)} blocks from the prompt's block {max(start, 0)}"
                                f"{'' if count is None else f' of {count}'}, the prefill holds {len(remote)}: "
                                "the block sizes differ")
    return remote[start:start + n], local[:n]


def fresh_blocks(groups: Sequence[Sequence[Any]]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """The blocks vLLM allocated for a pull (``KVCacheBlocks.blocks``: vLLM's blocks of each group,
    from the prompt's first): those neither in its prefix cache (hashed) nor a null placeholder, one
    tuple for one group, one per group for several; and per group the prompt block the first holds."""
    ids, starts = [], []
    for group in groups:
        fresh = [i for i, block in enumerate(group)
                 if block.block_hash is None and not getattr(block, "is_null", False)]
        ids.append(tuple(int(group[i].block_id) for i in fresh))
        starts.append(fresh[0] if fresh else len(group))
    return (ids[0] if len(ids) == 1 else tuple(ids)), tuple(starts)


def groups_of(block_ids: Sequence[Any]) -> list[list[int]]:
    """Block ids as one list per KV cache group (a flat list is one group)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(map(int, g)) for g in block_ids]
    return [list(map(int, block_ids))]


NULL_BLOCK = 0  # vLLM's placeholder for a block a group no longer holds (out of a sliding window)


def pair_groups(local: Sequence[Any], remote: Sequence[Any], starts: Sequence[int] = (),
                count: int | None = None) -> tuple[list[int], list[int]]:
    """(prefill blocks, decode blocks) of a request, group by group (``match_blocks``; ``starts``:
    each group's ``start``, ``count`` the prompt's blocks). With several KV cache groups (vLLM's
    hybrid allocator), a pair where either side is a block vLLM dropped (a sliding window's oldest,
    ``NULL_BLOCK``) is skipped: the decode never reads that position. The caches overlay the
    groups, so one list of pairs covers them all.

    Raises: IncompatibleCache when the group counts differ or a group wants more than it holds."""
    local_groups, remote_groups = groups_of(local), groups_of(remote)
    if len(local_groups) != len(remote_groups):
        raise IncompatibleCache(f"the prefill sent {len(remote_groups)} KV cache groups, this decode has "
                                f"{len(local_groups)}")
    if starts and len(starts) != len(local_groups):
        raise IncompatibleCache(f"{len(starts)} group starts for {len(local_groups)} KV cache groups")
    src, dst = [], []
    for g, (mine, theirs) in enumerate(zip(local_groups, remote_groups)):
        s, d = match_blocks(mine, theirs, starts[g] if starts else None, count)
        for a, b in zip(s, d):
            if len(local_groups) == 1 or NULL_BLOCK not in (a, b):  # one group: block ids as they are
                src.append(a)
                dst.append(b)
    return src, dst


@dataclass(frozen=True)
class Pairs:
    """What a pull reads and writes: the prefill's and this decode's vLLM blocks, pair by pair, or
    where the two run different block sizes, their granules (``b * pieces + p``: piece ``p`` of
    block ``b``, ``pieces`` a side: ``(prefill's, decode's)``); ``blocks``: the decode's vLLM
    blocks either fills."""

    src: list[int]
    dst: list[int]
    blocks: list[int]
    pieces: tuple[int, int] | None = None


def pair_granules(local: Sequence[Any], remote: Sequence[Any], tokens: int, block_sizes: tuple[int, int],
                  granule: int, starts: Sequence[int] = ()) -> Pairs:
    """A request's granules, group by group, where the prefill's blocks (``block_sizes[0]``
    tokens) and the decode's (``block_sizes[1]``) differ in size: each group's blocks cover the
    prompt's ``tokens`` from the start (the decode's fresh ones from its block ``starts[g]``, or
    without ``starts`` its last), so granule ``g`` holds tokens ``g * granule`` onwards on both
    sides. Only granules holding prompt tokens are read; as in ``pair_groups``, a block vLLM
    dropped from a window (``NULL_BLOCK``) on either side is skipped.

    Raises: IncompatibleCache when a block size is not a multiple of the granule, the group counts
    differ, or a side holds fewer tokens than the prompt."""
    (p_size, d_size), local_groups, remote_groups = block_sizes, groups_of(local), groups_of(remote)
    if p_size % granule or d_size % granule:
        raise IncompatibleCache(f"block sizes {p_size} (prefill) and {d_size} (decode) are not both multiples of "
                                f"{granule} tokens: their blocks cannot be cut in common pieces")
    if len(local_groups) != len(remote_groups) or (starts and len(starts) != len(local_groups)):
        raise IncompatibleCache(f"the prefill sent {len(remote_groups)} KV cache groups, this decode has "
                                f"{len(local_groups)}")
    p_pieces, d_pieces = p_size // granule, d_size // granule
    end = -(-tokens // granule)  # granules holding a prompt token
    src, dst, blocks = [], [], []
    for i, (mine, theirs) in enumerate(zip(local_groups, remote_groups)):
        # the decode's first fresh granule
        first = (starts[i] if starts else -(-tokens // d_size) - len(mine)) * d_pieces
        if first < 0 or len(theirs) * p_pieces < end or len(mine) * d_pieces < end - first:
            raise IncompatibleCache(f"the prefill holds {len(theirs)} blocks of {p_size} tokens, the decode "
                                    f"{len(mine)} of {d_size}: not the {tokens} tokens of the prompt")
        for g in range(first, end):
            a, b = theirs[g // p_pieces], mine[(g - first) // d_pieces]
            if len(local_groups) > 1 and NULL_BLOCK in (a, b):
                continue
            src.append(a * p_pieces + g % p_pieces)
            dst.append(b * d_pieces + (g - first) % d_pieces)
            if not blocks or blocks[-1] != b:
                blocks.append(b)
    return Pairs(src, dst, blocks, (p_pieces, d_pieces))


def flat_blocks(block_ids: Sequence[Any]) -> list[int]:
    return [b for g in groups_of(block_ids) for b in g]


def tp_shape(ours: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(KV heads in all, prefill TP, decode TP) of a pull; equal sizes where either record lacks them."""
    if ours is None or theirs is None or not ours.get("kv_heads"):
        return 1, 1, 1
    return int(ours["kv_heads"]), int(theirs.get("tp", 1)), int(ours.get("tp", 1))


def merge_records(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The transfers of one pull (one per prefill rank read) as one record: the first that did
    not end done, else their sums (bytes) and the longest time."""
    for r in records:
        if r.get("state") != "done":
            return r
    if len(records) == 1:
        return records[0]
    raw, wire = sum(r.get("bytes_raw") or 0 for r in records), sum(r.get("bytes_wire") or 0 for r in records)
    return {**records[0], "bytes_raw": raw, "bytes_wire": wire, "ratio": round(raw / wire, 3) if wire else None,
            "seconds": max(r.get("seconds") or 0.0 for r in records), "transfers": [r.get("id") for r in records]}


class Consumer:
    """Decode worker: pulls each request's KV from its prefill's sidecar into the local cache.

    vLLM's step makes no call that waits: ``start`` writes a pull's request itself where that cannot
    wait (``_send_early``) and hands the rest to a worker thread (the first contact with a
    prefill's sidecar, its checks, the transfers' submission and their long-polled ends); ``poll``
    collects the ends at the next steps and copies the pages.

    Where the prefill runs another tensor-parallel size, the pull is one transfer per prefill rank
    this rank reads (``kvferry.client.tp``): the heads it holds of that rank's lease, written
    into their place in this rank's head-major mirror."""

    def __init__(self, config: ConnectorConfig, cache: KvCache, rank: int = 0, clock=time.monotonic,
                 compat: Mapping[str, Any] | None = None):
        self.config, self.cache, self.rank, self.clock = config, cache, rank, clock
        self.compat = dict(compat) if compat is not None else None
        self.pulls: dict[str, Pull] = {}
        self.failed_blocks: dict[str, tuple[int, ...]] = {}  # request id -> its blocks that did not load
        self._peers = PeerClients(config)
        # (sidecar, lease rank, granules a prefill block) that fit ours -> the prefill's vLLM blocks
        self._checked: dict[tuple[str, str, int | None], int] = {}
        self._data_address: str | None = None
        self._local = Client(config.url, token=config.token, timeout=config.call_timeout)
        self._lock = threading.Lock()
        self.stats: list[dict[str, Any]] = []
        self.interval = TransferStats()  # what vLLM's get_kv_connector_stats takes
        self._waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="kvferry-pull")
        self._registering = threading.Lock()  # one check of the cache's registration at a time
        # the Watches ask this decode's own sidecar: its token, not the prefills'
        self.watches = Watches(config.token, config.call_timeout) if config.control == "auto" else None

    def remote(self, url: str) -> Client:
        return self._peers.get(url)

    def start(self, spec: LoadSpec) -> Pull:
        """Hand the pull to a worker thread; never raises, never waits (a failure is reported as a
        failed load by ``poll``). A spec without local blocks only ends the prefill's lease."""
        pull = Pull(spec, self.clock())
        try:
            check_remote(spec.params, self.config)
        except RefusedPrefill as exc:  # nothing is asked of a prefill this decode does not call
            if flat_blocks(spec.local_blocks):
                pull.error, pull.kind = f"{type(exc).__name__}: {exc}", "incompatible"
                self.pulls[spec.request_id] = pull
            else:
                log.error("kvferry: the lease of request %s is left to expire: %s", spec.request_id, exc)
            return pull
        if not flat_blocks(spec.local_blocks):
            self._release_later(pull)
            return pull
        self.pulls[spec.request_id] = pull
        early = self._send_early(pull)
        try:
            pull.ended = self._waiters.submit(self._run, pull, early)
        except RuntimeError as exc:  # closing
            if early is not None:
                early.cancel()
            pull.error, pull.kind = f"the connector is closing: {exc}", "transfer"
        return pull

    def _send_early(self, pull: Pull) -> Early | None:
        """On vLLM's step thread: the pull and the ask for its end, sent now where neither can wait
        (one transfer, both sidecars met before; over HTTP on connections already open,
        ``warm_only``, and a gRPC Watch, which never waits to start), so the pull leaves before a
        worker thread wakes, which a step busy in Python holds off for up to the interpreter's
        switch interval (5 ms); None, with nothing sent, where the worker thread must send it.
        Never raises."""
        spec = pull.spec
        try:
            url = spec.params["url"]
            local = None
            if self.watches is not None:
                met, local = self.watches.met(self.config.url)
                if not met:
                    return None
            if self.compat is not None:
                check_compat(self.compat, spec.params.get("compat"), url)
            pieces = self.slices(spec)
            if len(pieces) != 1:
                return None
            pairs = self._pairs(pull)
            client = self.remote(url)
            request = self._request(pull, url, pieces[0], pairs, contact=False)
            if request is None:
                return None
            transfer_id, asked = uuid.uuid4().hex, time.time()
            answer = client.send_later(*request, wait=0, transfer_id=transfer_id, warm_only=True)
        except Exception:  # noqa: BLE001 (nothing was sent: the worker thread sends it and reports what fails)
            return None
        pull.client, pull.asked_wall = client, asked
        try:
            ending = self._watch_end(transfer_id, local, self.config.load_timeout, warm_only=True)
        except Exception:  # noqa: BLE001 (the worker thread asks for the end)
            ending = None
        return Early(transfer_id, answer, ending)

    def slices(self, spec: LoadSpec) -> list[tp.Slice]:
        """What this rank reads from which prefill rank (one slice of all its heads from the rank
        of its own number where both run one tensor-parallel size)."""
        heads, p_tp, d_tp = tp_shape(self.compat, spec.params.get("compat"))
        if p_tp == d_tp:
            return [tp.Slice(self.rank, 0, 0, self.cache.layout.heads)]
        mine = len(tp.rank_heads(heads, d_tp, self.rank))
        if self.cache.layout.heads != mine:
            raise IncompatibleCache(f"this decode's cache pages hold {self.cache.layout.heads} KV heads, not the "
                                    f"{mine} of rank {self.rank} of {d_tp}: a prefill of tensor-parallel size {p_tp} "
                                    "cannot be read head by head")
        return tp.plan(heads, p_tp, d_tp, self.rank)

    def _run(self, pull: Pull, early: Early | None = None) -> dict[str, Any]:
        """On a worker thread: check the prefill (first contact), send the pulls (the first unless
        ``early`` did), long-poll their ends (at most ``LONG_POLL`` seconds a call) until they
        ended or ``load_timeout`` passed."""
        deadline = time.monotonic() + self.config.load_timeout
        spec = pull.spec
        url = spec.params["url"]
        records, pending = [], []
        # Each pull gets its id before it is sent, so that this decode's own sidecar, which writes
        # the KV and knows it arrived a DONE's trip before the prefill does, is asked for its end
        # first and the two requests overlap; the prefill's answer only says it started.
        try:
            if self.compat is not None:
                check_compat(self.compat, spec.params.get("compat"), url)
            pairs = self._pairs(pull)
            pull.client = self.remote(url)
            local = self.watches.stream_for(self.config.url, self._local) if self.watches is not None else None
            pieces = self.slices(spec)
            self._submit_pieces(pull, url, pieces, pairs, local, deadline, records, pending, early)
        except BaseException:
            if early is not None and not records:
                early.cancel()  # its answers were never read
            for _, ending in pending:
                ending.cancel()
            raise
        pull.transfer_id = pull.transfer_ids[0]
        pushed = local is not None
        for i, record in enumerate(records):
            delay, ending = 0.05, pending[i]
            while record["state"] in ("queued", "running"):
                left = deadline - time.monotonic()
                if left <= 0:
                    if ending is not None:
                        ending[1].cancel()
                    break
                record, by_watch = self._end_of(pull, record["id"], left, local, ending)
                records[i], ending = record, None
                if overloaded(record) and time.monotonic() + delay < deadline:
                    # The receiver had too many incoming transfers and wrote nothing: sent again
                    # with jittered backoff, as the SDK's calls are.
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(2.0, delay * 2)
                    transfer_id, fresh = uuid.uuid4().hex, []

                    def ask(transfer_id: str = transfer_id, fresh: list = fresh) -> None:
                        if not fresh:
                            fresh.append(self._watch_end(transfer_id, local, deadline - time.monotonic()))
                    try:
                        record = records[i] = self._send(pull, url, pieces[i], pairs, transfer_id, ask)
                    except BaseException:
                        for _, unread in fresh:
                            unread.cancel()
                        raise
                    ending = fresh[0] if fresh else None
                    pull.transfer_ids[i] = record["id"]
                elif record["state"] not in ("queued", "running"):
                    pushed = pushed and by_watch
        pull.transfer_id = pull.transfer_ids[0]
        pull.answered, pull.answered_wall = self.clock(), time.time()
        pull.control = "grpc" if pushed else "http"
        return merge_records(records)

    def _submit_pieces(self, pull: Pull, url: str, pieces: list[tp.Slice], pairs: Pairs,
                       local: Stream | None, deadline: float, records: list[dict[str, Any]],
                       pending: list[tuple[Stream | None, Any]], early: Early | None = None) -> None:
        """Submit each piece under an id drawn here, its end asked of this decode's sidecar first
        (the first piece's sent already by ``early``, if given)."""
        for index, piece in enumerate(pieces):
            first = early if index == 0 else None
            transfer_id = first.transfer_id if first is not None else uuid.uuid4().hex

            def ask(transfer_id: str = transfer_id, index: int = index) -> None:
                """As each try is sent: the wait for its announce counts from the latest try (a
                lease the prefill had not taken yet is asked for again, later)."""
                watch = self._watch_end(transfer_id, local, deadline - time.monotonic())
                if len(pending) > index:
                    pending[index][1].cancel()
                    pending[index] = watch
                else:
                    pending.append(watch)
            # The prefill takes the lease on a thread of its own, so a pull may come a moment before
            # it: a missing lease is asked for again for LEASE_GRACE seconds before the pull fails,
            # first after 1 ms (a lease is taken in about that: a first wait of 10 ms cost a GPU
            # harness's pulls 11 ms each).
            grace, pause = time.monotonic() + min(LEASE_GRACE, self.config.load_timeout), 0.001
            while True:
                try:
                    if first is not None:
                        sent, first = first, None
                        if sent.ending is not None:
                            pending.append(sent.ending)
                        else:
                            ask()
                        records.append(sent.answer.result())
                    else:
                        records.append(self._send(pull, url, piece, pairs, transfer_id, ask))
                    break
                except NotFound:
                    if time.monotonic() + pause > grace:
                        raise
                    time.sleep(pause)
                    pause = min(0.2, pause * 2)
            pull.transfer_ids.append(records[-1]["id"])

    def _watch_end(self, transfer_id: str, local: Stream | None, left: float,
                   warm_only: bool = False) -> tuple[Stream | None, Any]:
        """Ask this decode's own sidecar for the end of ``transfer_id`` now (a gRPC Watch where
        ``local`` serves it, else a long-poll), to be read by ``_end_of``."""
        wait, appear = max(0.001, min(LONG_POLL, left)), max(0.001, min(APPEAR, left))
        if local is not None:
            try:
                return local, local.sender.watch_end(transfer_id, wait, appear)
            except Exception as exc:  # noqa: BLE001 (a channel that cannot start a call: long-polled instead)
                log.info("kvferry: cannot watch transfer %s on %s (%s); over HTTP", transfer_id, local.target, exc)
        return None, self._local.transfer_later(transfer_id, wait=wait, appear=appear, warm_only=warm_only)

    def _end_of(self, pull: Pull, transfer_id: str, left: float, local: Stream | None,
                pending: tuple[Stream | None, Any] | None = None) -> tuple[dict[str, Any], bool]:
        """A pulled transfer's record at its end (or its state after a long-poll), and whether a
        Watch brought it: this decode's own sidecar's, once the prefill announced it there (asked
        by ``pending``, or now); while it is not announced (a same-host write is announced behind
        its data), the prefill's as it stands, which says whether it ended there before it was
        announced (refused, or failed). Where this decode's sidecar failed or cancelled it, the
        prefill's record once that ended too (``SENDER_WORD``), else this sidecar's: a receiver's
        failure is the pull's at once, never a wait for a sender that has not ended yet."""
        until = time.monotonic() + left
        stream, ending = pending if pending is not None else self._watch_end(transfer_id, local, left)
        try:
            mine = self.watches.ended(stream, ending) if stream is not None else ending.result()
            by_watch = stream is not None and mine is not None
            if mine is None:  # the watch broke or passed its wait
                rest = max(0.001, until - time.monotonic())
                mine = self._local.transfer(transfer_id, wait=min(LONG_POLL, rest), appear=min(APPEAR, rest))
        except NotFound:
            return pull.client.transfer(transfer_id), False
        if mine["state"] not in ("failed", "cancelled"):
            return mine, by_watch
        try:  # why, in the sender's words (what it was told, or what it found itself)
            theirs = pull.client.transfer(transfer_id, wait=max(0.0, min(SENDER_WORD, until - time.monotonic())))
        except (EngineError, httpx.HTTPError):
            return mine, by_watch
        return (theirs if theirs["state"] in ("failed", "cancelled") else mine), by_watch

    def _request(self, pull: Pull, url: str, piece: tp.Slice, pairs: Pairs,
                 contact: bool = True) -> tuple[str, Any, str, str, Any, str] | None:
        """The pull of ``piece`` as ``send_later``'s first arguments (lease, its blocks, this
        sidecar's data address, this cache's region, its blocks, codec), the prefill rank's blocks
        checked at the first contact; None where that contact is still to come and not ``contact``."""
        lease = lease_names(pull.spec.params, [piece.rank])[0]
        heads, p_tp, d_tp = tp_shape(self.compat, pull.spec.params.get("compat"))
        layout = self.cache.layout
        theirs = layout.heads if p_tp == d_tp else len(tp.rank_heads(heads, p_tp, piece.rank))
        p_pieces, d_pieces = pairs.pieces or (None, None)
        key = (url, f"{p_tp}:{piece.rank}", p_pieces)
        if (key not in self._checked or self._data_address is None) and not contact:
            return None
        if key not in self._checked:
            self._checked[key] = layout.check_peer(pull.client.region(lease), url, theirs, p_pieces)
        if self._data_address is None:
            self._data_address = self._local.data_address()
        codec = pull.spec.params.get("codec") or self.config.codec  # a request may name its codec
        if pairs.pieces is not None:
            return (lease, layout.granules(pairs.src, piece.src, piece.count, theirs, p_pieces), self._data_address,
                    self.cache.name, layout.granules(pairs.dst, piece.dst, piece.count, None, d_pieces), codec)
        return (lease, layout.blocks(pairs.src, self._checked[key], piece.src, piece.count, theirs),
                self._data_address, self.cache.name, layout.blocks(pairs.dst, None, piece.dst, piece.count), codec)

    def _send(self, pull: Pull, url: str, piece: tp.Slice, pairs: Pairs, transfer_id: str,
              then: Callable[[], None] | None = None) -> dict[str, Any]:
        """Check the prefill rank's blocks (first contact) and send the pull of ``piece`` as
        transfer ``transfer_id`` (over HTTP: a gRPC Submit reached the prefill's engine 1 ms later,
        decision 033): its record once started. ``then`` runs once the request is sent, before its
        answer is read (the decode's own sidecar asked for the end meanwhile)."""
        request = self._request(pull, url, piece, pairs)
        pull.asked_wall = pull.asked_wall or time.time()
        answer = pull.client.send_later(*request, wait=0, transfer_id=transfer_id)
        if then is not None:
            then()
        return answer.result()

    def poll(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids, each reported once; received ones are in vLLM's cache.
        Asks nobody: a pull still on its way past ``load_timeout`` fails here, and its transfers are
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
            if pull.stopping is not None and not pull.stopping.done():
                continue  # reported once its transfers no longer write into the blocks vLLM gets back
            del self.pulls[rid]
            if pull.error is None:
                received.add(rid)
                self._record(pull)
            else:
                failed.add(rid)
                self.failed_blocks[rid] = tuple(flat_blocks(pull.spec.local_blocks))
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
            pull.error = (f"transfer {pull.record.get('id')} {state}: {pull.record.get('error_kind')}: "
                          f"{pull.record.get('error')}")
            pull.kind = failure_kind(pull.error)
            if "NotFound" in pull.error:  # a region missing: this decode's sidecar may have restarted
                self._check_registered()
            # Its last chunk may still be decoding into the blocks: reported once that is over.
            self._cancel_later(pull, remote=False)
        else:
            pull.error, pull.kind = f"transfer {pull.record.get('id')} not done after {self.config.load_timeout:g} s", \
                "timeout"
            self._cancel_later(pull)

    def _check_registered(self) -> None:
        """On a worker thread: register the cache again where this decode's sidecar no longer knows
        it (it restarted, its regions gone), so that the pulls after this failed one find it."""
        def check() -> None:
            with self._registering:
                try:
                    self._local.region(self.cache.name)
                    return
                except NotFound:
                    pass
                except (EngineError, httpx.HTTPError):
                    return  # not answering: the next failure asks again
                try:
                    self.cache.alias(self.cache.name)
                    log.warning("kvferry: the decode's sidecar no longer knew cache region %s (a restart): "
                                "registered again", self.cache.name)
                except (EngineError, httpx.HTTPError) as exc:
                    log.error("kvferry: cannot register cache region %s again: %s", self.cache.name, exc)
        try:
            self._waiters.submit(check)
        except RuntimeError:
            pass

    def _cancel_later(self, pull: Pull, remote: bool = True) -> None:
        """Cancel a failed pull's transfers on a worker thread, on this decode's own sidecar first
        (it answers once nothing of them writes into the blocks any more, also for one that ended
        already, and tells the sender), then on the prefill's (``remote``). ``poll`` reports the
        failure once that is done: vLLM may hand the blocks to another request then."""
        def cancel() -> None:
            try:
                if pull.ended is not None:
                    pull.ended.result(timeout=self.config.call_timeout)  # its transfer ids, once sent
            except Exception:  # noqa: BLE001 (the pull failed anyway: nothing to cancel)
                pass
            for transfer_id in list(pull.transfer_ids):
                for client in (self._local, pull.client) if remote else (self._local,):
                    if client is None:
                        continue
                    try:
                        client.cancel(transfer_id)
                    except (EngineError, httpx.HTTPError):
                        pass  # ended already, or not there; the request fails either way
        try:
            pull.stopping = self._waiters.submit(cancel)
        except RuntimeError:
            pass

    def _local_blocks(self, pull: Pull) -> list[int]:
        return self._pairs(pull).blocks

    def _pairs(self, pull: Pull) -> Pairs:
        if pull.pairs is None:
            pull.pairs = self.pairs(pull.spec)
        return pull.pairs

    def pairs(self, spec: LoadSpec) -> Pairs:
        """What ``spec``'s pull reads and writes: block for block, or granule for granule where
        the prefill's block size is not this decode's.

        Raises: IncompatibleCache (different block sizes and a cache lent in place, or no
        granules in common)."""
        theirs, ours = int(spec.params.get("block_size") or 0), int((self.compat or {}).get("block_size") or 0)
        tokens = spec.tokens or int(spec.params.get("num_tokens") or 0)
        if not theirs or not ours or theirs == ours:
            size = ours or theirs
            count = -(-tokens // size) if tokens and size else None  # the prompt's blocks
            src, dst = pair_groups(spec.local_blocks, spec.params["block_ids"], spec.starts, count)
            return Pairs(src, dst, dst)
        granule = self.cache.layout.granule
        if granule is None:
            raise IncompatibleCache(f"the prefill's blocks hold {theirs} tokens, this decode's {ours}: a cache lent in "
                                    "place (in_place) moves whole blocks; different block sizes need in_place: false "
                                    "on both instances")
        return pair_granules(spec.local_blocks, spec.params["block_ids"], tokens, (theirs, ours), granule, spec.starts)

    def _leases(self, spec: LoadSpec, loaded: bool) -> list[str]:
        """The prefill leases this rank ends (``tp.releases``): its own where both run one
        tensor-parallel size."""
        heads, p_tp, d_tp = tp_shape(self.compat, spec.params.get("compat"))
        if p_tp == d_tp:
            return lease_names(spec.params, [self.rank])
        return lease_names(spec.params, tp.releases(heads, p_tp, d_tp, self.rank, loaded))

    def _release_later(self, pull: Pull) -> None:
        """End the prefill's leases this rank ends, whatever happened, on a worker thread: vLLM's
        step does not wait for that HTTP call, and the prefill frees the blocks once the lease is gone."""
        try:
            check_remote(pull.spec.params, self.config)
            leases, url = self._leases(pull.spec, pull.ended is not None), pull.spec.params["url"]
        except (KeyError, TypeError, ValueError, RefusedPrefill):
            return
        for lease in leases:
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
        release(self.remote(url), lease)

    def _record(self, pull: Pull) -> None:
        r = pull.record
        entry = {"request_id": pull.spec.request_id, "wait_seconds": self.clock() - pull.started,
                 "transfer_seconds": r.get("seconds"), "answer_seconds": pull.answered - pull.started,
                 "load_seconds": pull.load_seconds, "blocks": len(self._local_blocks(pull)),
                 "bytes_raw": r.get("bytes_raw"), "bytes_wire": r.get("bytes_wire"), "ratio": r.get("ratio"),
                 "codec": r.get("chosen_codec"), "transfer_id": pull.transfer_id, "stages": r.get("stages"),
                 "transfers": list(pull.transfer_ids), "control": pull.control}
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
        if self.watches is not None:
            self.watches.close()
        self._peers.close()
        self._local.close()


_open_warned = threading.Event()  # the warning that prefill_urls is not set, given once a process


class PeerClients:
    """One API client per prefill sidecar (by URL), made on first use and shared by threads: only
    for the sidecars ``prefill_urls`` admits, since each carries this decode's ``remote_token``."""

    def __init__(self, config: ConnectorConfig):
        self._config, self._lock, self._clients = config, threading.Lock(), {}
        if not config.prefill_urls and config.peer_token() and not _open_warned.is_set():
            _open_warned.set()
            log.warning("kvferry: prefill_urls is not set: this decode sends its token for prefill sidecars to "
                        "whatever sidecar URL a request's kv_transfer_params name; list the prefill sidecars in "
                        "prefill_urls (KVFERRY_CONNECTOR_PREFILL_URLS)")

    def get(self, url: str) -> Client:
        """Raises: RefusedPrefill for a sidecar ``prefill_urls`` does not list."""
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                if not self._config.admits(url):
                    raise RefusedPrefill(f"the prefill sidecar {url!r} is not among this decode's prefill_urls")
                client = self._clients[url] = Client(url, token=self._config.peer_token(),
                                                     timeout=self._config.call_timeout)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def release(client: Client, lease: str) -> None:
    """Delete a prefill's lease (the prefill frees its blocks once it is gone); a lease not there
    is asked for again for ``RELEASE_GRACE`` seconds (not taken yet, or pulled and ended already),
    and so is one its transfer still holds: the decode's sidecar records the KV arrived before
    the prefill's hears the DONE that ends the transfer there."""
    grace, pause = time.monotonic() + RELEASE_GRACE, 0.001
    while True:
        try:
            client.delete_region(lease)
            return
        except (NotFound, Conflict) as exc:
            if time.monotonic() + pause > grace:
                if isinstance(exc, Conflict):
                    log.debug("kvferry: lease %s not deleted: %s", lease, exc)
                return
            time.sleep(pause)
            pause = min(0.2, pause * 2)
        except (EngineError, httpx.HTTPError) as exc:  # the lease expires on its own
            log.debug("kvferry: lease %s not deleted: %s", lease, exc)
            return


class Heartbeats:
    """Decode scheduler: renews the prefill leases of requests waiting in vLLM's queue (every
    ``heartbeat_seconds``, one call per prefill sidecar), from the request's arrival until its pull
    starts or it is finished, so a queue longer than ``lease_seconds`` does not lose the KV."""

    def __init__(self, config: ConnectorConfig, clock=time.monotonic):
        self.config, self.clock = config, clock
        self._tracked: dict[str, Mapping[str, Any]] = {}
        self._lock = threading.Lock()
        self._peers = PeerClients(config)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._releases: ThreadPoolExecutor | None = None
        self.sent = 0  # heartbeat calls made (for the tests and the log)

    def track(self, request_id: str, params: Mapping[str, Any]) -> None:
        """Renew ``params``' leases until ``untrack``; none of a prefill this decode does not call."""
        try:
            check_remote(params, self.config)
        except RefusedPrefill as exc:
            log.error("kvferry: the leases of request %s are not renewed: %s", request_id, exc)
            return
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
        if self._releases is not None:
            self._releases.shutdown(wait=False, cancel_futures=True)
        self._peers.close()

    def shared_leases(self, params: Mapping[str, Any], compat: Mapping[str, Any] | None) -> list[str]:
        """The leases of a request that several of this decode's ranks read (``tp.shared``): no
        rank may end one alone, so the scheduler does once vLLM reports the request loaded (or
        failed) on every rank."""
        heads, p_tp, d_tp = tp_shape(compat, params.get("compat"))
        return [] if p_tp == d_tp else lease_names(params, tp.shared(heads, p_tp, d_tp))

    def release_later(self, url: str, leases: Sequence[str]) -> None:
        """End ``leases`` on a thread (the scheduler's step makes no HTTP call)."""
        if self._releases is None:
            self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-release")
        for lease in leases:
            try:
                self._releases.submit(lambda name=lease: release(self._client(url), name))
            except RuntimeError:  # closing: the lease expires on its own
                return

    def _client(self, url: str) -> Client:
        return self._peers.get(url)

    def beat(self) -> None:
        """One round: renew every tracked request's leases, grouped by prefill sidecar (one call
        each, or several where they are more than a call may name: ``MAX_RENEW``)."""
        with self._lock:
            tracked = list(self._tracked.items())
        by_url: dict[str, list[str]] = {}
        for _, params in tracked:
            try:
                by_url.setdefault(params["url"], []).extend(lease_names(params))
            except (KeyError, TypeError, ValueError):
                continue
        for url, names in by_url.items():
            try:
                answer = self._client(url).renew_leases(names, self.config.lease_seconds)
                self.sent += 1
            except (EngineError, httpx.HTTPError, RefusedPrefill) as exc:
                log.warning("kvferry: heartbeat to %s failed: %s", url, exc)
                continue
            if answer.get("missing"):
                log.warning("kvferry: the prefill at %s no longer holds leases %s: those requests' KV is gone",
                            url, answer["missing"][:4])

    def _beat(self) -> None:
        while not self._closed.wait(self.config.heartbeat):
            self.beat()
