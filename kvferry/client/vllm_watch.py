"""The decode's transfer ends pushed by a gRPC ``Watch`` instead of long-polled over HTTP.

Where a prefill's sidecar serves gRPC (its ``/v1/health`` names a ``grpc_port``) and grpcio is
installed, the connector submits its pulls there over gRPC, tagged with its own submitter, and one
long-lived ``Watch(mine, follow)`` stream per prefill sidecar, on the connector's own event-loop
thread, hands each transfer's end to the worker thread waiting for it: one push, no request in
flight per pull. HTTP stays the fallback: for a prefill without gRPC, and for a pull whose gRPC
Submit finds the sidecar unreachable.

No completion is lost with the stream: a waiting pull that hears nothing for ``RECHECK`` seconds,
or whose stream broke and is dialled again, asks for its transfer's record over HTTP; where the
prefill's sidecar no longer knows it (it restarted) or cannot be reached, the decode's own
sidecar's record of the incoming transfer tells whether the KV arrived.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvferry.engine.errors import EngineError, NotFound, TransferFailed

from .sdk import Blocks, Client

log = logging.getLogger("kvferry.vllm")

CONTROLS = ("auto", "http")  # the connector's ``control`` setting: Watch where served, or HTTP only
RECHECK = 1.0  # seconds a waiting pull hears nothing before it asks over HTTP (a safety net)
ENDED = 4096  # ended transfers a stream remembers, for a Submit answered after its end was pushed
REDIAL_FOR = 30.0  # seconds a broken stream is dialled again before it is started afresh
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
    """A pull's transfer waited on: ``record`` once its end was pushed; ``event`` wakes the waiter
    for it, or to ask over HTTP (``recheck``)."""

    id: str
    submitted: float
    event: threading.Event = field(default_factory=threading.Event)
    record: dict[str, Any] | None = None
    recheck: bool = False


class Stream:
    """One prefill sidecar's gRPC client and Watch, living on the event-loop thread."""

    def __init__(self, target: str, token: str, timeout: float):
        from .grpc import GrpcClient

        self.target = target
        self.client = GrpcClient(target, token=token or None, timeout=timeout)
        self.waiters: dict[str, Waiter] = {}
        self.ended: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.pushed = 0  # ends handed to a waiter by the stream
        self.redials = 0
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        """Watch this client's transfers for ever, started afresh should the sidecar stay away."""
        while True:
            oldest = min((w.submitted for w in self.waiters.values()), default=time.time())
            try:
                async for event in self.client.watch(mine=True, follow=True, reconnect_timeout=REDIAL_FOR,
                                                     since=oldest - 1.0, on_redial=self.redialled):
                    if event.status is None:
                        self._nudge(event.id)
                    elif event.status.terminal:
                        self._ended(event.id, dict(event.status.record))
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (a stream that failed is dialled again; waits go by HTTP)
                log.warning("kvferry: the Watch of %s stopped (%s); waiting pulls ask over HTTP", self.target, exc)
                self.redialled()
                await asyncio.sleep(1.0)

    def redialled(self) -> None:
        """The stream broke: every waiting pull asks for its transfer over HTTP once."""
        self.redials += 1
        for transfer_id in list(self.waiters):
            self._nudge(transfer_id)

    async def submit(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                     codec: str) -> Waiter:
        transfer_id = await self.client.submit(src_region, src_blocks, peer, dst_region, dst_blocks, codec=codec)
        waiter = Waiter(transfer_id, time.time())
        record = self.ended.get(transfer_id)
        if record is not None:  # its end came before the Submit's answer
            self.pushed += 1
            waiter.record = record
            waiter.event.set()
        else:
            self.waiters[transfer_id] = waiter
        return waiter

    def _ended(self, transfer_id: str, record: dict[str, Any]) -> None:
        waiter = self.waiters.pop(transfer_id, None)
        if waiter is not None:
            self.pushed += 1
            waiter.record = record
            waiter.event.set()
            return
        self.ended[transfer_id] = record
        while len(self.ended) > ENDED:
            self.ended.popitem(last=False)

    def _nudge(self, transfer_id: str) -> None:
        waiter = self.waiters.get(transfer_id)
        if waiter is not None:
            waiter.recheck = True
            waiter.event.set()


class Watches:
    """The decode's Watch streams, one per prefill sidecar serving gRPC, on one thread of their own
    (started with the first). Worker threads call ``stream_for``, ``submit`` and ``wait``."""

    def __init__(self, token: str, timeout: float):
        self.token, self.timeout = token, timeout
        self._targets: dict[str, str | None] = {}  # prefill URL -> its gRPC target (None: HTTP)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._available = grpc_available()

    def stream_for(self, url: str, client: Client) -> Stream | None:
        """The Watch of the prefill at ``url`` (``client``: its REST API), started at first contact;
        None where it serves no gRPC or grpcio is missing. Raises what ``client.health`` raises."""
        with self._lock:
            if url in self._targets:
                target = self._targets[url]
                return None if target is None else self._streams.get(target)
        target = grpc_target(url, client.health()) if self._available else None
        with self._lock:
            self._targets[url] = target
            if target is None or target in self._streams:
                return None if target is None else self._streams[target]
            loop = self._start_loop()
        stream = asyncio.run_coroutine_threadsafe(self._open(target), loop).result(self.timeout)
        log.info("kvferry: transfer ends from %s come by its gRPC Watch (%s)", url, target)
        return stream

    async def _open(self, target: str) -> Stream:
        with self._lock:
            stream = self._streams.get(target)
            if stream is None:
                stream = self._streams[target] = Stream(target, self.token, self.timeout)
                stream.task = asyncio.get_running_loop().create_task(stream.run())
        return stream

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="kvferry-watch", daemon=True)
            self._thread.start()
        return self._loop

    def submit(self, stream: Stream, src_region: str, src_blocks: Blocks, peer: str, dst_region: str,
               dst_blocks: Blocks, codec: str) -> Waiter | None:
        """Submit a pull over gRPC; None where the sidecar could not be reached that way (the
        caller sends it over HTTP). Raises: EngineError (the sidecar refused it: as over HTTP)."""
        import grpc

        coroutine = stream.submit(src_region, src_blocks, peer, dst_region, dst_blocks, codec)
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(self.timeout + 1.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # it may have been submitted: not sent twice
                raise
            log.warning("kvferry: gRPC Submit to %s failed (%s); over HTTP", stream.target, exc.details())
            return None

    def wait(self, stream: Stream, waiter: Waiter, deadline: float, remote: Client, local: Client) -> dict[str, Any]:
        """The transfer's record once it ended, or its last known state once ``deadline`` (monotonic)
        passed. Pushed by the stream; asked for over HTTP after ``RECHECK`` seconds of silence or a
        broken stream (``remote``: the prefill's API, ``local``: this decode's sidecar's)."""
        record: dict[str, Any] = {"id": waiter.id, "state": "running"}
        try:
            while True:
                left = deadline - time.monotonic()
                waiter.event.wait(max(0.0, min(RECHECK, left)))
                if waiter.record is not None:
                    return waiter.record
                if left <= 0:
                    return record
                waiter.event.clear()
                waiter.recheck = False
                if waiter.record is not None:
                    return waiter.record
                record = asked(waiter.id, remote, local) or record
                if record["state"] in TERMINAL:
                    return record
        finally:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(stream.waiters.pop, waiter.id, None)

    def pushed(self) -> int:
        """Transfer ends the streams handed to a waiting pull (not found by asking)."""
        return sum(s.pushed for s in list(self._streams.values()))

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shut() -> None:
            for stream in list(self._streams.values()):
                if stream.task is not None:
                    stream.task.cancel()
                await stream.client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop).result(5.0)
        except Exception:  # noqa: BLE001 (closing: the streams die with the loop)
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5.0)
        self._loop = None


def overloaded(record: Mapping[str, Any]) -> bool:
    """The receiver refused the transfer as overloaded (nothing written): worth sending again."""
    return record["state"] == "failed" and record.get("error_kind") == "Overloaded"


def failure(record: Mapping[str, Any]) -> TransferFailed:
    """A failed or cancelled transfer's record as the error a submit that waited for it raises
    over HTTP, so a pull reports it in the same words whichever way its end came."""
    return TransferFailed(f"transfer {record.get('id')} {record['state']}: {record.get('error_kind')}: "
                          f"{record.get('error')}", record["state"], record.get("error_kind"))


def asked(transfer_id: str, remote: Client, local: Client) -> dict[str, Any] | None:
    """The transfer's record asked over HTTP: the prefill's, or where that sidecar no longer knows it
    or cannot be reached, the decode's own record of it once done there (its KV arrived); None
    while neither can tell. Raises: what the prefill answered, where the KV did not arrive."""
    try:
        return remote.transfer(transfer_id)
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
