"""The UCX backend over ucxx (the maintained successor of ucx-py): TCP, RDMA or CUDA IPC,
whatever UCX finds. The only module that imports ucxx. Host and CUDA buffers go to UCX as they
are (``__cuda_array_interface__``), so GPU-to-GPU needs no staging where UCX can do it.

ucxx is initialized once per process with the caller's UCX options and progress mode
(``TransportConfig.ucx_progress_mode``); in its thread modes the notifier thread is stopped at
exit, as ucxx requires.
Listeners always enable endpoint error handling, so endpoints do too.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# UCX reads UCX_MEMTYPE_CACHE when libucs loads, and ucxx loads it before it sets its own default
# (off), so the default must be in the environment before the import. With the cache on, a CUDA
# buffer whose allocation UCX's hooks did not see (torch's pool allocates before UCX starts) is
# taken for host memory and handed to send(2): transfers fail with "Input/output error".
os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
import ucxx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402  (what ucxx's own sends wrap a buffer in, and their tag)
from ucxx.types import Tag  # noqa: E402
from ucxx.exceptions import UCXCanceled, UCXCloseError, UCXError

from .config import TransportConfig
from .errors import ConnectError, PeerLost, TransportClosed
from .link import Link, ListenerHandle, OnLink, log


_started = False
_HANDLER_DRAIN_S = 2.0
# Host parts up to this size (headers, peer messages) are posted at once by ``send_now``: copied,
# so the caller may reuse its buffer, and not awaited, so a message leaves without a turn of the loop.
_POST_NOW_BYTES = 64 << 10
# At most this many posted sends uncompleted (a peer that stops reading): later parts are awaited.
_POST_NOW_PENDING = 256
_FLUSH_S = 0.2  # what a closing link waits at most for its posted sends


@functools.cache
def _init(options: tuple[tuple[str, str], ...], progress_mode: str) -> None:
    global _started
    # UCX_* set in the environment win over our defaults: operators tune UCX the usual way.
    # Python futures (a notifier thread) exist only in ucxx's thread modes.
    threaded = progress_mode.startswith("thread")
    ucxx.init(options=dict(options), env_takes_precedence=True, progress_mode=progress_mode,
              enable_python_future=threaded)
    _started = True
    if threaded:
        atexit.register(ucxx.stop_notifier_thread)
    log.info("ucxx initialized in %r progress mode with UCX options %s (UCX_* environment variables take "
             "precedence)", progress_mode, dict(options))


def shutdown() -> None:
    """Stop ucxx's notifier thread and release UCX; must run before the event loop closes, or
    closing hangs. A later listen/connect initializes UCX again (on the then-running loop)."""
    global _started
    if _started:
        ucxx.stop_notifier_thread()
        try:
            ucxx.reset()
        except Exception as exc:  # live endpoints keep UCX up; the process is ending anyway
            log.warning("ucxx reset incomplete: %s", exc)
        _started = False
        _init.cache_clear()


def _ensure(config: TransportConfig) -> None:
    _init(tuple(sorted(config.ucx_options.items())), config.ucx_progress_mode)


class UcxLink(Link):
    streams = False
    def __init__(self, endpoint: Any, peer: str, post_now: bool = True):
        """``post_now``: ``send_now`` posts small parts and progresses the worker itself; only
        where the loop's thread owns the worker (ucxx's blocking and polling modes, not its
        thread modes, whose progress thread would race it)."""
        self._ep = endpoint
        self.peer = peer
        self._closed = False
        self._post_now = post_now
        self._posted: list[tuple[Any, Any]] = []  # (request, buffer) of sends posted and not yet seen complete
        self._tag = Tag(endpoint._tags["msg_send"]) if post_now else None  # the tag ``send`` uses

    def send_now(self, parts: list[Any]) -> list[Any]:
        """Post small host parts as UCX sends here and now, in order, without awaiting them (UCX
        sends of one endpoint go out in the order posted; each buffer is a copy, held until its
        send completes); stops at the first device or large part, or once ``_POST_NOW_PENDING``
        sends are uncompleted, and ``send_rest`` awaits the rest (the backpressure there was).

        Raises:
            PeerLost: a send posted earlier failed, or the endpoint is closed or broken.
        """
        if not self._post_now:
            return parts
        self._reap()
        posted = 0
        for part in parts:
            if not isinstance(part, (bytes, bytearray, memoryview)) or memoryview(part).nbytes > _POST_NOW_BYTES \
                    or len(self._posted) >= _POST_NOW_PENDING:
                break
            buffer = np.frombuffer(bytes(part), dtype=np.uint8)
            try:
                self._ep._ep.raise_on_error()
                request = self._ep._ep.tag_send(Array(buffer), self._tag)
            except (UCXError, UCXCanceled, UCXCloseError, AttributeError) as exc:
                raise self._lost(exc) from exc
            self._posted.append((request, buffer))
            posted += 1
        if posted:
            self._ep._ctx.worker.progress()  # out now: nothing else progresses the worker before its next event
        return parts[posted:]

    def _reap(self) -> None:
        """Forget posted sends that completed; raise for one that failed."""
        if not self._posted:
            return
        pending = []
        for request, buffer in self._posted:
            if not request.completed:
                pending.append((request, buffer))
                continue
            try:
                request.check_error()
            except (UCXError, UCXCanceled, UCXCloseError) as exc:
                self._posted = []
                raise self._lost(exc) from exc
        self._posted = pending

    async def _flush_posted(self) -> None:
        """Give sends posted at once (a GOODBYE last of all) up to ``_FLUSH_S`` to leave before the
        endpoint closes, which would cancel them."""
        deadline = asyncio.get_running_loop().time() + _FLUSH_S
        while any(not request.completed for request, _ in self._posted) \
                and asyncio.get_running_loop().time() < deadline:
            try:
                self._ep._ctx.worker.progress()
            except (UCXError, UCXCanceled, UCXCloseError, AttributeError):
                break
            await asyncio.sleep(0.001)
        self._posted = []

    async def send(self, header: bytes, payload: Any = None) -> None:
        try:
            await self._ep.send(np.frombuffer(header, dtype=np.uint8))
            if payload is not None and len(payload):
                await self._ep.send(payload)
        except (UCXError, UCXCanceled, UCXCloseError) as exc:
            raise self._lost(exc) from exc

    async def send_rest(self, parts: list[Any]) -> None:
        """Each part is one UCX message (a header, or a payload as it is: host or CUDA)."""
        try:
            for part in parts:
                await self._ep.send(np.frombuffer(part, dtype=np.uint8) if isinstance(part, (bytes, memoryview))
                                    else part)
        except (UCXError, UCXCanceled, UCXCloseError) as exc:
            raise self._lost(exc) from exc

    async def recv_header(self, size: int) -> bytes:
        buf = np.empty(size, dtype=np.uint8)
        await self._recv(buf)
        return buf.tobytes()

    async def recv_payload(self, region: Any, check: Callable[[Any], bool] | None = None,
                           striped: bool = False) -> bool:
        view = region
        if isinstance(region, memoryview):
            region = np.frombuffer(region, dtype=np.uint8)
        await self._recv(region)
        # A device payload is checked on its GPU (its digest), a host one on the CPU.
        return check is None or check(view)

    async def _recv(self, buf: Any) -> None:
        try:
            await self._ep.recv(buf)
        except (UCXError, UCXCanceled, UCXCloseError) as exc:
            raise self._lost(exc) from exc

    def _lost(self, exc: Exception) -> Exception:
        return TransportClosed("link closed") if self._closed else PeerLost(f"{self.peer}: {type(exc).__name__}: {exc}")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._flush_posted()
            try:
                await self._ep.close()
            except (UCXError, UCXCanceled, UCXCloseError, asyncio.CancelledError):
                pass


class UcxListener(ListenerHandle):
    def __init__(self, listener: Any):
        self._listener = listener
        self.port = listener.port

    async def close(self) -> None:
        if self._listener is not None:
            # Handlers hold the listener; it (and its port) lives until they end.
            deadline = asyncio.get_running_loop().time() + _HANDLER_DRAIN_S
            while self._listener.active_clients and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            if self._listener.active_clients:
                log.warning("closing a UCX listener with %d handler(s) still running", self._listener.active_clients)
            self._listener.close()
            self._listener = None
            # The UCX listener goes when its last reference does; handler frames can hold one
            # in a cycle, and until it goes the port cannot be bound again.
            gc.collect()


async def listen(host: str, port: int, on_link: OnLink, config: TransportConfig) -> UcxListener:
    _ensure(config)

    async def handler(endpoint: Any) -> None:
        await on_link(UcxLink(endpoint, "ucx-peer", _owns_worker(config)))

    deadline = asyncio.get_running_loop().time() + (config.connect_timeout if port else 0.0)
    while True:
        try:
            listener = ucxx.create_listener(handler, port, endpoint_error_handling=True,
                                            connect_timeout=config.connect_timeout)
            return UcxListener(listener)
        except UCXError as exc:
            # A listener closed a moment ago may still hold a fixed port until UCX lets it go.
            if asyncio.get_running_loop().time() >= deadline:
                raise ConnectError(f"cannot listen on port {port}: {exc}") from exc
        gc.collect()
        await asyncio.sleep(0.1)


async def connect(host: str, port: int, config: TransportConfig) -> UcxLink:
    _ensure(config)
    try:
        endpoint = await asyncio.wait_for(
            ucxx.create_endpoint(host, port, endpoint_error_handling=True, connect_timeout=config.connect_timeout),
            config.connect_timeout + 1.0,
        )
    except (UCXError, OSError, asyncio.TimeoutError, TimeoutError) as exc:
        raise ConnectError(f"cannot connect to {host}:{port} over UCX: {type(exc).__name__}: {exc}") from exc
    return UcxLink(endpoint, f"{host}:{port}", _owns_worker(config))


def _owns_worker(config: TransportConfig) -> bool:
    """Whether the event loop's thread progresses the worker (no progress thread of ucxx's)."""
    return not config.ucx_progress_mode.startswith("thread")
