"""The decode's transfer ends pushed by gRPC instead of long-polled over HTTP.

A decode learns that a pull's KV arrived from its *own* sidecar, which writes the KV and records
the transfer done a DONE's trip before the prefill's sidecar hears of it. Where that sidecar serves
gRPC (its ``/v1/health`` names a ``grpc_port``) and grpcio is installed, the worker thread that
submitted the pull reads the end from a ``Watch`` of that one transfer on its own sidecar
(``GrpcSender.ended``: grpc's single-threaded streams, read on the calling thread, no hop through an
event loop or another thread). The pull itself goes to the prefill's sidecar over HTTP, which
reaches its engine sooner than a gRPC ``Submit`` does. HTTP stays the fallback for the end: a
sidecar without gRPC, one that cannot be reached that way, and a stream that broke or passed its wait.

No completion is lost: a transfer not announced to the decode's sidecar within a moment (refused by
it, queued on the prefill, or a same-host write announced behind its data) is asked for at the
prefill, and a stream that ends without the end makes the pull ask its own sidecar over HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kvferry.engine.errors import EngineError, NotFound

from .sdk import Client

log = logging.getLogger("kvferry.vllm")

CONTROLS = ("auto", "http")  # the connector's ``control`` setting: gRPC streams where served, or HTTP only
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


class Stream:
    """One sidecar's gRPC channel, shared by the worker threads' calls."""

    def __init__(self, target: str, token: str, timeout: float):
        from .grpc import GrpcSender

        self.target = target
        self.sender = GrpcSender(target, token=token or None, timeout=timeout)
        self.pushed = 0  # ends a Watch brought
        self.asked = 0  # ends a Watch did not bring (broke, or its wait passed), asked for over HTTP
        self._lock = threading.Lock()

    def count(self, pushed: bool) -> None:
        with self._lock:
            if pushed:
                self.pushed += 1
            else:
                self.asked += 1


class Watches:
    """The decode's gRPC channel to its own sidecar, where that serves gRPC, for the ends of its
    pulls. Worker threads call ``stream_for`` and ``ended``; the step thread ``met``."""

    def __init__(self, token: str, timeout: float):
        self.token, self.timeout = token, timeout
        self._targets: dict[str, str | None] = {}  # sidecar URL -> its gRPC target (None: HTTP)
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._available = grpc_available()

    def met(self, url: str) -> tuple[bool, Stream | None]:
        """Whether the sidecar at ``url`` was met already, and its channel (None: it serves no
        gRPC); asks nobody."""
        with self._lock:
            if url not in self._targets:
                return False, None
            target = self._targets[url]
            return True, None if target is None else self._streams.get(target)

    def stream_for(self, url: str, client: Client) -> Stream | None:
        """The channel to the sidecar at ``url`` (``client``: its REST API), opened at first
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
                log.info("kvferry: %s answers over gRPC (%s)", url, target)
            return stream

    def ended(self, stream: Stream, ending: Any) -> dict[str, Any] | None:
        """A transfer's record at its end, read from ``ending`` (``GrpcSender.watch_end`` on the
        decode's own sidecar, ``stream``) on this thread; None where the stream broke or its wait
        passed first (ask over HTTP).

        Raises: NotFound (not announced there within the watch's ``appear`` seconds)."""
        import grpc

        try:
            record = ending.result()
        except grpc.RpcError as exc:
            log.info("kvferry: the watch of transfer %s on %s broke (%s); asking over HTTP", ending.id,
                     stream.target, exc.code())
            record = None
        except EngineError as exc:
            if isinstance(exc, NotFound):
                raise
            log.info("kvferry: the watch of transfer %s on %s refused (%s); asking over HTTP", ending.id,
                     stream.target, exc)
            record = None
        stream.count(record is not None)
        return record

    def pushed(self) -> int:
        """Transfer ends a Watch brought to a waiting pull (not found by asking)."""
        return sum(s.pushed for s in list(self._streams.values()))

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.sender.close()


def overloaded(record: Mapping[str, Any]) -> bool:
    """The receiver refused the transfer as overloaded (nothing written): worth sending again."""
    return record["state"] == "failed" and record.get("error_kind") == "Overloaded"
