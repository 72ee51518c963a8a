"""The asyncio TCP backend: raw non-blocking sockets (``sock_sendall``/``sock_recv_into``, no
StreamReader copies). Device buffers are staged through host memory."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from collections.abc import Callable

from .config import TransportConfig
from .errors import ConnectError, PeerLost, TransportClosed
from .link import Link, ListenerHandle, OnLink, log

_SOCKET_BUFFER = 4 << 20
# Reads take what the socket has, up to this much: a header and its small payload, and the
# messages behind them, cost one system call rather than one each. Large payloads bypass it.
_READ_AHEAD = 64 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one sendmsg takes


class TcpLink(Link):
    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._ahead = bytearray(_READ_AHEAD)
        self._head = self._tail = 0  # the unread bytes of ``_ahead``
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"

    async def send(self, header: bytes, payload: Any = None) -> None:
        try:
            await self._loop.sock_sendall(self._sock, header)
            if payload is not None and len(payload):
                await self._loop.sock_sendall(self._sock, _host_bytes(payload))
        except OSError as exc:
            raise self._lost(exc) from exc

    def send_now(self, parts: list[Any]) -> list[Any]:
        """Non-blocking ``sendmsg`` of every part (at most ``IOV_MAX`` buffers a call); what did
        not fit is returned."""
        parts = [memoryview(_host_bytes(part)).cast("B") for part in parts]
        done = 0
        while done < len(parts):
            batch = parts[done:done + _IOV_MAX]
            try:
                sent = self._sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise self._lost(exc) from exc
            for part in batch:
                if sent < len(part):
                    return [part[sent:], *parts[done + 1:]]
                sent -= len(part)
                done += 1
        return []

    async def send_rest(self, parts: list[Any]) -> None:
        try:
            for part in parts:
                await self._loop.sock_sendall(self._sock, part)
        except OSError as exc:
            raise self._lost(exc) from exc

    async def recv_header(self, size: int) -> bytes:
        while self._tail - self._head < size:
            await self._fill()
        start = self._head
        self._head += size
        return bytes(self._ahead[start:self._head])

    stages_device_payloads = True

    async def recv_payload(self, region: Any, check: Callable[[Any], bool] | None = None) -> bool:
        if getattr(region, "is_cuda", False):
            staging = bytearray(region.numel())
            await self._recv_exactly(memoryview(staging))
            if check is not None and not check(staging):
                return False  # checked before it reaches the device
            import torch

            region.copy_(torch.frombuffer(staging, dtype=torch.uint8))
            return True
        await self._recv_exactly(region)
        return check is None or check(region)

    async def _recv_exactly(self, view: memoryview) -> None:
        """Fill ``view``: from what was read ahead, then small rests through the read-ahead buffer
        and large ones straight from the socket."""
        got, total = self._take(view), len(view)
        while got < total:
            if total - got < _READ_AHEAD // 2:
                await self._fill()
                got += self._take(view[got:])
            else:
                got += await self._recv_into(view[got:])

    def _take(self, view: memoryview) -> int:
        n = min(len(view), self._tail - self._head)
        if n:
            view[:n] = self._ahead[self._head:self._head + n]
            self._head += n
        return n

    async def _fill(self) -> None:
        """Read what the socket has (at least one byte) behind the unread bytes."""
        if self._head:
            unread = self._tail - self._head
            self._ahead[:unread] = self._ahead[self._head:self._tail]
            self._head, self._tail = 0, unread
        self._tail += await self._recv_into(memoryview(self._ahead)[self._tail:])

    async def _recv_into(self, view: memoryview) -> int:
        try:
            n = await self._loop.sock_recv_into(self._sock, view)
        except OSError as exc:
            raise self._lost(exc) from exc
        if n == 0:
            raise TransportClosed("link closed") if self._closed else PeerLost("peer closed the connection")
        return n

    def _lost(self, exc: OSError) -> Exception:
        return TransportClosed("link closed") if self._closed else PeerLost(f"{self.peer}: {exc}")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def _host_bytes(payload: Any) -> Any:
    if getattr(payload, "is_cuda", False):
        return memoryview(payload.cpu().numpy())
    return payload


class TcpListener(ListenerHandle):
    def __init__(self, sock: socket.socket, on_link: OnLink):
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._on_link = on_link
        self._handlers: set[asyncio.Task] = set()
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                log.warning("tcp accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            task = loop.create_task(self._on_link(TcpLink(conn)))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._sock.close()


async def listen(host: str, port: int, on_link: OnLink, config: TransportConfig) -> TcpListener:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return TcpListener(sock, on_link)


async def connect(host: str, port: int, config: TransportConfig) -> TcpLink:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectError(f"cannot resolve {host}: {exc}") from exc
    family, _, proto, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), config.connect_timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
        raise ConnectError(f"cannot connect to {host}:{port}: {reason}") from exc
    return TcpLink(sock)
