"""The decode's transfer ends pushed by gRPC instead of long-polled over HTTP.

Where a prefill's sidecar serves gRPC (its ``/v1/health`` names a ``grpc_port``) and grpcio is
installed, the connector submits each pull there with ``SubmitAndWatch``: one server stream per
pull, its record once started, then at its end. The worker thread that submitted the pull reads
the stream itself (``GrpcSender``, grpc's single-threaded streams), so a transfer's end reaches it
without a hop through an event loop or another thread: the hops of a shared ``Watch`` stream read
on a thread of its own cost each end about 0.3 ms more on a loaded host. HTTP stays the fallback:
for a prefill without gRPC, and for a pull whose gRPC submit finds the sidecar unreachable.

No completion is lost with a stream: one that breaks (the sidecar restarted or cannot be reached),
or ends without the end (its ``WATCH_FOR`` seconds passed), makes the waiting pull ask for its
transfer's record over HTTP; where the prefill's sidecar no longer knows it (it restarted) or
cannot be reached, the decode's own sidecar's record of the incoming transfer tells whether the KV
arrived. A pull that times out cancels its transfer, which ends its stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvferry.engine.errors import EngineError, NotFound

from .sdk import Blocks, Client

log = logging.getLogger("kvferry.vllm")

CONTROLS = ("auto", "http")  # the connector's ``control`` setting: gRPC streams where served, or HTTP only
WATCH_FOR = 60.0  # seconds a pull's stream waits for its end before the pull asks over HTTP
RECHECK = 1.0  # seconds between HTTP long-polls of a pull whose stream ended without its end
TERMINAL = ("done", "failed", "cancelled")


def grpc_available() -> bool:
    """Whether the grpc extra is installed (the connector works without it, over HTTP)."""
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError:
        return False
    return True


def grpc_target(url: str, health: Mapping[str, Any]) -> str | None:
    """``host:port`` of the gRPC control plane of the sidecar at ``url`` (REST), from its health
    record: its ``grpc_port`` at the host the URL names (gRPC listens where REST does); None when off."""
    port = int(health.get("grpc_port") or 0)
    if not port:
        return None
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Waiter:
    """A pull's transfer waited on: its stream (``watched``, read by ``Watches.wait``), and
    ``record`` once the stream brought its end."""

    id: str
    submitted: float
    watched: Any = None  # kvferry.client.grpc.Watched, until read
    record: dict[str, Any] | None = None


class Stream:
    """One prefill sidecar's gRPC channel, shared by the worker threads' per-pull streams."""

    def __init__(self, target: str, token: str, timeout: float):
        from .grpc import GrpcSender

        self.target = target
        self.sender = GrpcSender(target, token=token or None, timeout=timeout)
        self.pushed = 0  # ends a pull's stream brought
        self.asked = 0  # pulls whose stream broke or ended without the end, asked for over HTTP
        self._lock = threading.Lock()

    def count(self, pushed: bool) -> None:
        with self._lock:
            if pushed:
                self.pushed += 1
            else:
                self.asked += 1


class Watches:
    """The decode's gRPC channels, one per prefill sidecar serving gRPC. Worker threads call
    ``stream_for``, ``submit`` and ``wait``; each reads its own pulls' streams."""

    def __init__(self, token: str, timeout: float):
        self.token, self.timeout = token, timeout
        self._targets: dict[str, str | None] = {}  # prefill URL -> its gRPC target (None: HTTP)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._available = grpc_available()

    def stream_for(self, url: str, client: Client) -> Stream | None:
        """The channel to the prefill at ``url`` (``client``: its REST API), opened at first
        contact; None where it serves no gRPC or grpcio is missing. Raises what ``client.health`` raises."""
        with self._lock:
            if url in self._targets:
                target = self._targets[url]
                return None if target is None else self._streams.get(target)
        target = grpc_target(url, client.health()) if self._available else None
        with self._lock:
            self._targets[url] = target
            if target is None:
                return None
            stream = self._streams.get(target)
            if stream is None:
                stream = self._streams[target] = Stream(target, self.token, self.timeout)
                log.info("kvferry: transfer ends from %s come by gRPC streams (%s)", url, target)
            return stream

    def submit(self, stream: Stream, src_region: str, src_blocks: Blocks, peer: str, dst_region: str,
               dst_blocks: Blocks, codec: str) -> Waiter | None:
        """Submit a pull over gRPC, on this thread; None where the sidecar could not be reached that
        way (the caller sends it over HTTP). Raises: EngineError (the sidecar refused it: as over HTTP)."""
        import grpc

        try:
            watched = stream.sender.start(src_region, src_blocks, peer, dst_region, dst_blocks, codec,
                                          wait=WATCH_FOR)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # it may have been submitted: not sent twice
                raise
            log.warning("kvferry: gRPC submit to %s failed (%s); over HTTP", stream.target, exc.details())
            return None
        return Waiter(watched.id, time.time(), watched)

    def wait(self, stream: Stream, waiter: Waiter, deadline: float, remote: Client, local: Client) -> dict[str, Any]:
        """The transfer's record once it ended, or its last known state once ``deadline`` (monotonic)
        passed. Read from its stream on this thread; asked for over HTTP where the stream broke or
        ended without it (``remote``: the prefill's API, ``local``: this decode's sidecar's)."""
        import grpc

        if waiter.record is not None:
            return waiter.record
        record: dict[str, Any] = {"id": waiter.id, "state": "running"}
        watched, waiter.watched = waiter.watched, None
        if watched is not None:
            try:
                end = watched.end()
            except grpc.RpcError as exc:
                log.info("kvferry: the stream of transfer %s from %s broke (%s); asking over HTTP", waiter.id,
                         stream.target, exc.code())
                end = None
            stream.count(end is not None)
            if end is not None:
                waiter.record = end
                return end
            record = watched.record
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return record
            answer = asked(waiter.id, remote, local, min(RECHECK, left))
            if answer is None:  # neither sidecar could tell: ask again a little later
                time.sleep(min(RECHECK, left))
                continue
            record = answer
            if record["state"] in TERMINAL:
                return record

    def pushed(self) -> int:
        """Transfer ends the streams brought to a waiting pull (not found by asking)."""
        return sum(s.pushed for s in list(self._streams.values()))

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.sender.close()


def overloaded(record: Mapping[str, Any]) -> bool:
    """The receiver refused the transfer as overloaded (nothing written): worth sending again."""
    return record["state"] == "failed" and record.get("error_kind") == "Overloaded"


def asked(transfer_id: str, remote: Client, local: Client, wait: float = 0.0) -> dict[str, Any] | None:
    """The transfer's record asked over HTTP (long-polled up to ``wait`` seconds): the prefill's,
    or where that sidecar no longer knows it or cannot be reached, the decode's own record of it
    once done there (its KV arrived); None while neither can tell. Raises: what the prefill
    answered, where the KV did not arrive."""
    try:
        return remote.transfer(transfer_id, wait=wait)
    except (NotFound, httpx.HTTPError) as exc:
        try:
            mine = local.transfer(transfer_id)
        except (EngineError, httpx.HTTPError):
            mine = None
        if mine is not None and mine.get("state") == "done":
            return {**mine, "id": transfer_id}
        if isinstance(exc, NotFound):
            raise NotFound(f"transfer {transfer_id} is gone from the prefill's sidecar (it restarted?) and did "
                           "not arrive here") from None
        raise
    except EngineError as exc:
        log.debug("kvferry: asking for transfer %s: %s", transfer_id, exc)
        return None
