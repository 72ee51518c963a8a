"""The asyncio TCP backend: raw non-blocking sockets (``sock_sendall``/``sock_recv_into``, no
StreamReader copies). Device payloads are staged through pinned host memory by a worker thread
(``tcp_device``), their copies overlapping the socket."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from collections.abc import Callable

from .config import TransportConfig
from .errors import ConnectError, PeerLost, TransportClosed
from .link import Link, ListenerHandle, OnLink, log
from .tcp_device import DeviceStaging

_SOCKET_BUFFER = 4 << 20
# Reads take what the socket has, up to this much: a header and its small payload, and the
# messages behind them, cost one system call rather than one each. Large payloads bypass it.
_READ_AHEAD = 64 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one sendmsg takes


class TcpLink(Link):
    def __init__(self, sock: socket.socket, io_timeout: float = 30.0):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._ahead = bytearray(_READ_AHEAD)
        self._head = self._tail = 0  # the unread bytes of ``_ahead``
        self._io_timeout = io_timeout  # a device payload's socket calls give up after this long idle
        self._staged_out = DeviceStaging()
        self._staged_in = DeviceStaging()
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"

    async def send(self, header: bytes, payload: Any = None) -> None:
        try:
            await self._loop.sock_sendall(self._sock, header)
        except OSError as exc:
            raise self._lost(exc) from exc
        if payload is not None and len(payload):
            await self.send_rest([payload])

    def send_now(self, parts: list[Any]) -> list[Any]:
        """Non-blocking ``sendmsg`` of every part (at most ``IOV_MAX`` buffers a call) up to the
        first device payload; what did not go is returned."""
        device = next((i for i, part in enumerate(parts) if getattr(part, "is_cuda", False)), len(parts))
        parts, later = [memoryview(part).cast("B") for part in parts[:device]], parts[device:]
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
                    return [part[sent:], *parts[done + 1:], *later]
                sent -= len(part)
                done += 1
        return later

    async def send_rest(self, parts: list[Any]) -> None:
        try:
            for part in parts:
                if getattr(part, "is_cuda", False):
                    await asyncio.to_thread(self._staged_out.send, self._sock, part, self._io_timeout)
                else:
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
        if getattr(region, "is_cuda", False) and (check is None or getattr(check, "on_device", False)):
            # Checked on the GPU once landed (or not checked here): straight into the region.
            await self._recv_device(region)
            return check is None or check(region)
        if getattr(region, "is_cuda", False):
            # A host-checked payload is checked before it reaches the device.
            staging = bytearray(region.numel())
            await self._recv_exactly(memoryview(staging))
            if check is not None and not check(staging):
                return False  # checked before it reaches the device
            import torch

            region.copy_(torch.frombuffer(staging, dtype=torch.uint8))
            return True
        await self._recv_exactly(region)
        return check is None or check(region)

    async def _recv_device(self, region: Any) -> None:
        """What was read ahead, copied as it is; the rest by the staging thread."""
        n = min(region.numel(), self._tail - self._head)
        if n:
            import torch

            region[:n].copy_(torch.frombuffer(self._ahead, dtype=torch.uint8, count=n, offset=self._head))
            self._head += n
        if n < region.numel():
            try:
                await asyncio.to_thread(self._staged_in.recv, self._sock, region[n:], self._io_timeout)
            except OSError as exc:
                raise self._lost(exc) from exc

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


class TcpListener(ListenerHandle):
    def __init__(self, sock: socket.socket, on_link: OnLink, io_timeout: float):
        self._sock = sock
        self._io_timeout = io_timeout
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
            task = loop.create_task(self._on_link(TcpLink(conn, self._io_timeout)))
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
    return TcpListener(sock, on_link, config.op_timeout)


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
    return TcpLink(sock, config.op_timeout)
