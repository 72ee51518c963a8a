"""The asyncio TCP backend: raw non-blocking sockets (``sock_sendall``/``sock_recv_into``, no
StreamReader copies). Device payloads are staged through pinned host memory by a worker thread
(``tcp_device``), their copies overlapping the socket; large DATA payloads spread over several
sockets where the link has lanes (``lanes``).

Same-host peers (``TransportConfig.local_socket``) take a Unix stream socket instead: a listener
also accepts on the abstract socket named after its TCP address (``local_name``), and a dialler
whose peer address is one of its own network namespace's connects there first. The framing,
lanes and handshake are the same; the kernel's TCP path is skipped (a small message's round trip
between two processes halves)."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
from typing import Any

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .config import TransportConfig
from .errors import ConnectError, LinkAbsorbed, PeerLost, ProtocolError, TransportClosed, TransportTimeout
from . import lanes as lanes_
from .link import Link, ListenerHandle, OnLink, Striped, log
from .tcp_device import SLICE_BYTES, DeviceStaging, _recv_all, _send_parts, block_in_kernel

_SOCKET_BUFFER = 4 << 20
# Reads take what the socket has, up to this much: a header and its small payload, and the
# messages behind them, cost one system call rather than one each. Large payloads bypass it.
_READ_AHEAD = 64 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one sendmsg takes
_UNIX = getattr(socket, "AF_UNIX", None)
_LOCAL_SOCKETS = _UNIX is not None and sys.platform.startswith("linux")  # abstract names are Linux's
_WILDCARDS = ("", "0.0.0.0", "::")


def local_name(host: str, port: int) -> str:
    """The abstract Unix socket name a listener on ``host:port`` also accepts on (``*`` for a
    listener on every address). Abstract names belong to the network namespace, as TCP ports do:
    a name is reachable exactly where its TCP address is this host's own."""
    return f"\0kvferry/{'*' if host in _WILDCARDS else host}:{port}"


def is_own_address(family: int, host: str) -> bool:
    """Whether ``host`` (an IP address) is one of this network namespace's: it can be bound."""
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.bind((host, 0))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family != _UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)


def _size(buffer: Any) -> int:
    return buffer.numel() if hasattr(buffer, "numel") else len(buffer)


class TcpLink(Link):
    def __init__(self, sock: socket.socket, io_timeout: float = 30.0, gathering: lanes_.Gathering | None = None):
        _tune(sock)
        self._gathering = gathering  # an accepted socket's: it may open with a lane preamble
        self._absorbed = False  # a lane of another link now, which owns its socket
        self._sock = sock
        self.local = sock.family == _UNIX
        self._socks = [sock]  # lane 0 first; more once ``add_lanes``
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._ahead = bytearray(_READ_AHEAD)
        self._head = self._tail = 0  # the unread bytes of ``_ahead``
        self._io_timeout = io_timeout  # a worker thread's socket calls give up after this long idle
        self._staged_out = [DeviceStaging()]
        self._staged_in = [DeviceStaging()]
        self._workers: ThreadPoolExecutor | None = None  # this link's own: see ``_in_threads``
        try:
            if self.local:  # both ends see the listener's name: "unix:" and its TCP port
                name = sock.getpeername() or sock.getsockname()  # abstract names come back as bytes
                self.peer = "unix:" + (name.decode() if isinstance(name, bytes) else name).rpartition(":")[2]
            else:
                host, port = sock.getpeername()[:2]
                self.peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        except OSError:
            self.peer = "?"

    @property
    def lanes(self) -> int:  # type: ignore[override]
        return len(self._socks)

    def add_lanes(self, socks: list[socket.socket]) -> None:
        """Lanes 1... of this link (lane 0 is the socket it was made with). Only worker threads
        use them, so they block in the kernel: a slice per system call."""
        for sock in socks:
            _tune(sock)
            block_in_kernel(sock, self._io_timeout)
            self._socks.append(sock)
            self._staged_out.append(DeviceStaging())
            self._staged_in.append(DeviceStaging())

    async def send(self, header: bytes, payload: Any = None) -> None:
        try:
            await self._loop.sock_sendall(self._sock, header)
        except OSError as exc:
            raise self._lost(exc) from exc
        if payload is not None and len(payload):
            await self.send_rest([payload])

    def send_now(self, parts: list[Any]) -> list[Any]:
        """Non-blocking ``sendmsg`` of every part (at most ``IOV_MAX`` buffers a call) up to the
        first device or striped payload; what did not go is returned."""
        device = next((i for i, part in enumerate(parts) if isinstance(part, Striped) or getattr(part, "is_cuda", False)),
                      len(parts))
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
        for part in parts:
            nbytes = _size(part.payload) if isinstance(part, Striped) else 0
            if nbytes and lanes_.dealt(nbytes, self.lanes):
                # Device slices fit a pinned staging buffer; host slices need no staging.
                largest = SLICE_BYTES if getattr(part.payload, "is_cuda", False) else lanes_.SLICE
                dealer = lanes_.Dealer(nbytes, self.lanes, largest)
                await self._in_threads([functools.partial(self._send_lane, lane, part.payload, dealer.take)
                                        for lane in range(self.lanes)])
            elif isinstance(part, Striped) or getattr(part, "is_cuda", False):
                await self._in_threads([functools.partial(self._send_lane, 0, getattr(part, "payload", part), None)])
            else:
                try:
                    await self._loop.sock_sendall(self._sock, part)
                except OSError as exc:
                    raise self._lost(exc) from exc

    async def _in_threads(self, calls: list[Callable[[], None]]) -> None:
        """Each call at once in a worker thread (a lane's socket calls). The first failure is
        raised at once; the link is then failed and closed by its connection, which ends the
        other lanes' calls."""
        try:
            # Submitted here and now, not a loop turn later: a GPU call launched by the next
            # task must not hold a payload back from its lanes.
            await asyncio.gather(*(self._loop.run_in_executor(self._threads(), call) for call in calls))
        except TransportTimeout:  # a worker thread's socket call saw no progress
            raise
        except OSError as exc:
            raise self._lost(exc) from exc

    def _threads(self) -> ThreadPoolExecutor:
        """This link's worker threads, up to two a lane (a send and a receive on each at once): a peer that
        stalls or drips a payload holds its own link's threads, never the process's shared ones,
        which decode and copy for every other transfer."""
        if self._workers is None:
            self._workers = ThreadPoolExecutor(2 * lanes_.MAX_LANES, thread_name_prefix="kvferry-lane")
        return self._workers

    def _send_lane(self, lane: int, payload: Any, deal: Callable[[], tuple[int, int] | None] | None) -> None:
        """Send ``payload`` whole on ``lane``, or with ``deal`` the slices this lane takes from it."""
        sock, timeout = self._socks[lane], self._io_timeout

        def write(parts: list[Any]) -> None:
            _send_parts(sock, parts, timeout)

        if getattr(payload, "is_cuda", False):
            self._staged_out[lane].send(write, payload, deal)
            return
        view = memoryview(payload).cast("B")
        if deal is None:
            write([view])
            return
        while (span := deal()) is not None:
            write([lanes_.slice_header(*span), view[span[0]:span[0] + span[1]]])
        write([lanes_.slice_header(0, 0)])

    def _reader(self, lane: int) -> Callable[[memoryview], None]:
        """Fills a view from ``lane`` in a worker thread; lane 0's read-ahead first."""
        sock, timeout = self._socks[lane], self._io_timeout

        def read(view: memoryview) -> None:
            got = self._take(view) if lane == 0 else 0
            if got < len(view):
                _recv_all(sock, view[got:], timeout)

        return read

    def _recv_lane(self, lane: int, region: Any, tally: lanes_.Tally | None, nbytes: int) -> None:
        """Fill ``region`` (None: drop ``nbytes``) from ``lane``: whole, or with ``tally`` the
        slices this lane carries."""
        read = self._reader(lane)
        if getattr(region, "is_cuda", False):
            self._staged_in[lane].recv(read, region, tally)
            return
        scratch = memoryview(bytearray(1 << 20)) if region is None else None
        for start, size in lanes_.arriving(read, tally, nbytes):
            if scratch is None:
                read(region[start:start + size])
                continue
            for offset in range(0, size, len(scratch)):
                read(scratch[:min(len(scratch), size - offset)])

    async def recv_header(self, size: int) -> bytes:
        if self._gathering is not None:
            gathering, self._gathering = self._gathering, None
            await self._sort(gathering)
        while self._tail - self._head < size:
            await self._fill()
        start = self._head
        self._head += size
        return bytes(self._ahead[start:self._head])

    stages_device_payloads = True

    async def recv_payload(self, region: Any, check: Callable[[Any], bool] | None = None,
                           striped: bool = False) -> bool:
        on_device = getattr(region, "is_cuda", False)
        if on_device and not (check is None or getattr(check, "on_device", False)):
            # A host-checked payload is checked before it reaches the device.
            staging = bytearray(region.numel())
            await self._land(memoryview(staging), striped)
            if check is not None and not check(staging):
                return False
            import torch

            region.copy_(torch.frombuffer(staging, dtype=torch.uint8))
            return True
        await self._land(region, striped)  # a device payload is checked on its GPU, once landed
        return check is None or check(region)

    async def _land(self, region: Any, striped: bool) -> None:
        """Fill ``region``: host bytes of one lane on the loop; device bytes and dealt payloads by
        worker threads (lane 0's read-ahead first)."""
        nbytes = _size(region)
        if striped and lanes_.dealt(nbytes, self.lanes):
            await self._recv_dealt(region, nbytes)
        elif getattr(region, "is_cuda", False):
            await self._in_threads([functools.partial(self._recv_lane, 0, region, None, nbytes)])
        else:
            await self._recv_exactly(region)

    async def _recv_dealt(self, region: Any, nbytes: int) -> None:
        tally = lanes_.Tally(nbytes)
        await self._in_threads([functools.partial(self._recv_lane, lane, region, tally, nbytes)
                                for lane in range(self.lanes)])
        tally.check_whole()

    async def discard(self, nbytes: int, striped: bool = False) -> None:
        """Read and drop a payload of ``nbytes`` (a cancelled receive's), a bounded scratch at a time."""
        if striped and lanes_.dealt(nbytes, self.lanes):
            await self._recv_dealt(None, nbytes)
            return
        dropped = min(nbytes, self._tail - self._head)
        self._head += dropped
        if nbytes > dropped:
            await self._in_threads([functools.partial(self._recv_lane, 0, None, None, nbytes - dropped)])

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

    async def _sort(self, gathering: lanes_.Gathering) -> None:
        """An accepted socket's first read (inside its handshake's deadline and budget): a lane
        preamble files it with its link's other lanes. Lane 0 then waits for them all and goes on
        to the handshake; another lane is absorbed by it, ending this link quietly.

        Raises:
            LinkAbsorbed: this socket is another link's lane now.
            ProtocolError: a preamble out of place.
        """
        while self._tail - self._head < len(lanes_.MAGIC):
            await self._fill()
        if self._ahead[self._head:self._head + len(lanes_.MAGIC)] != lanes_.MAGIC:
            return  # a plain stream: its first bytes are the handshake's
        index, count, link_id = lanes_.unpack_preamble(await self.recv_header(lanes_.PREAMBLE.size))
        if index and self._tail != self._head:
            raise ProtocolError("bytes on a lane before its link was made")
        waiting = gathering.add(link_id, index, count, self._sock, self.peer.rpartition(":")[0])
        if index:
            self._absorbed = True
            raise LinkAbsorbed(f"lane {index} of a link from {self.peer}")
        self.add_lanes(await waiting)

    async def close(self) -> None:
        if not self._closed and not self._absorbed:
            self._closed = True
            for sock in self._socks:
                _close(sock, self._loop)
            if self._workers is not None:  # their calls end with their sockets
                self._workers.shutdown(wait=False)


def _close(sock: socket.socket, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Shut down and close ``sock``, off ``loop``'s watch first: a read or write still waiting on it
    would leave its descriptor registered, and the next socket given that number never be watched."""
    if loop is not None and sock.fileno() >= 0:
        loop.remove_reader(sock)
        loop.remove_writer(sock)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class TcpListener(ListenerHandle):
    def __init__(self, socks: list[socket.socket], on_link: OnLink, config: TransportConfig):
        self._socks = socks  # the TCP socket, then the Unix one where it is listened on
        self._io_timeout = config.op_timeout
        self._gathering = lanes_.Gathering(config.connect_timeout)
        self.port = socks[0].getsockname()[1]
        self._on_link = on_link
        self._handlers: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept_loop(sock)) for sock in socks]

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                log.warning("tcp accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            task = loop.create_task(self._on_link(TcpLink(conn, self._io_timeout, self._gathering)))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._gathering.drain()
        for sock in self._socks:
            sock.close()


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
    socks = [sock]
    if config.local_socket and _LOCAL_SOCKETS:
        bound_host, bound_port = sock.getsockname()[:2]
        local = _listen_local(local_name(bound_host, bound_port))
        socks += [local] if local is not None else []
    return TcpListener(socks, on_link, config)


def _listen_local(name: str) -> socket.socket | None:
    """The Unix socket same-host peers dial, or None (logged) if its name is held: a process in
    this namespace listens there already, and peers reach this listener over TCP."""
    sock = socket.socket(_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
    except OSError as exc:
        sock.close()
        log.warning("same-host peers reach this listener over TCP: the Unix socket %r is taken (%s)",
                    name.lstrip("\0"), exc)
        return None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def connect(host: str, port: int, config: TransportConfig) -> TcpLink:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectError(f"cannot resolve {host}:{port}: {exc}") from exc
    family, _, proto, _, address = infos[0]
    local = await _local_socket(address, family, config) if config.local_socket and _LOCAL_SOCKETS else None
    if local is not None:
        family, proto, address, first = _UNIX, 0, local.getpeername(), local
    else:
        first = socket.socket(family, socket.SOCK_STREAM, proto)
    socks = [first] + [socket.socket(family, socket.SOCK_STREAM, proto) for _ in range(config.tcp_lanes - 1)]
    link_id = os.urandom(16)
    try:
        async with asyncio.timeout(config.connect_timeout):
            for index, sock in enumerate(socks):
                sock.setblocking(False)
                if sock is not local:
                    await loop.sock_connect(sock, address)
                if config.tcp_lanes > 1:
                    await loop.sock_sendall(sock, lanes_.pack_preamble(index, config.tcp_lanes, link_id))
    except (OSError, TimeoutError) as exc:
        for sock in socks:
            sock.close()
        reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
        raise ConnectError(f"cannot connect to {host}:{port}: {reason}") from exc
    link = TcpLink(socks[0], config.op_timeout)
    link.add_lanes(socks[1:])
    return link


async def _local_socket(address: tuple, family: int, config: TransportConfig) -> socket.socket | None:
    """A Unix socket connected to the listener at ``address`` if that is this namespace's own
    address and the listener accepts there (its own name, then its every-address name); else
    None, and the caller dials TCP."""
    host, port = address[:2]
    if not is_own_address(family, host):
        return None
    loop = asyncio.get_running_loop()
    for name in (local_name(host, port), local_name("*", port)):
        sock = socket.socket(_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(config.connect_timeout):
                await loop.sock_connect(sock, name)
        except (OSError, TimeoutError):
            sock.close()
            continue
        return sock
    return None
