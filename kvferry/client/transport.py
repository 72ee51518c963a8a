"""A lean HTTP/1.1 client for the SDK: kept-alive sockets, requests written and responses parsed
here, and a request's answer readable on another thread than the one that sent it.

Through ``httpx.Client`` a request cost ~0.35 ms more than its round trip on the socket (URL
parsing, header models, transport layers), and ``http.client``'s header parser (the ``email``
package) another ~0.1 ms; a vLLM step and a one-block transfer feel both. The SDK talks plain
HTTP/1.1 to one sidecar, so it needs none of what they add (pooling across hosts, HTTP/2, proxies,
cookies). Errors are httpx's (``ConnectError``, ``ReadTimeout``, ...), so callers see one error tree.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx

MAX_LINE = 65536  # a status or header line longer than this is not from a sidecar
WARM_WRITE = 0.005  # seconds a request sent ``warm_only`` may take to write (a few hundred bytes: at once)
MAX_HEADERS = 100
_NO_BODY = (204, 304)


class NotWarm(httpx.ConnectError):
    """``warm_only``: no idle connection to the server was open, so nothing was sent."""


class _Malformed(Exception):
    """The response broke HTTP/1.1 (raised as ``httpx.RemoteProtocolError``)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A response as the SDK reads it: status, headers (names lower-case) and the whole body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class KeepAlive:
    """Requests to one ``http://`` server over kept-alive connections, one per request in flight
    (idle ones are reused by any thread). A connection the server closed while idle is replaced
    before use (never a request sent twice). A response must say where it ends (Content-Length or
    chunked), so one cut off is an error, never a shorter answer."""

    def __init__(self, host: str, port: int, headers: Mapping[str, str] | None = None):
        self.host, self.port = host, port
        named = f"[{host}]" if ":" in host else host
        self._head = _header_lines({"Host": f"{named}:{port}", **(headers or {})})
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    def request(self, method: str, target: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                timeout: float | None = None) -> Reply:
        """``target``: the path and query, percent-encoded; ``timeout``: for connecting, sending
        and each wait for the response's bytes alike."""
        return self.send(method, target, body, headers, timeout).response()

    def send(self, method: str, target: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
             timeout: float | None = None, warm_only: bool = False) -> Exchange:
        """Write the request now; its response is read by ``Exchange.response``, on any thread
        (the caller's work goes on while the server works). ``warm_only``: for a thread that must
        not wait (an engine's step): only on a connection already open, written within
        ``WARM_WRITE`` seconds, else ``NotWarm`` or a write error, and the server got no whole request."""
        head = f"{method} {target} HTTP/1.1\r\n{self._head}{_header_lines(headers or {})}"
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"Content-Length: {len(body)}\r\n"
        message = head.encode("latin-1") + b"\r\n"
        connection = self._take(timeout, connect=not warm_only)
        try:
            connection.sock.settimeout(WARM_WRITE if warm_only else timeout)
            if len(body) <= 65536:
                connection.sock.sendall(message + body)
            else:
                connection.sock.sendall(message)
                connection.sock.sendall(body)
            if warm_only:
                connection.sock.settimeout(timeout)  # the answer's wait
        except TimeoutError as exc:
            self._drop(connection)
            raise httpx.WriteTimeout(str(exc) or "timed out sending the request") from exc
        except OSError as exc:
            self._drop(connection)
            raise httpx.WriteError(f"{type(exc).__name__}: {exc}") from exc
        return Exchange(self, connection, method)

    def _take(self, timeout: float | None, connect: bool = True) -> _Connection:
        """An idle connection the server has not closed, or a new one (``connect``; else NotWarm)."""
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                break
            if not _closed_by_peer(connection.sock):
                return connection
            self._drop(connection)
        if not connect:
            raise NotWarm(f"no idle connection to {self.host}:{self.port}")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or f"timed out connecting to {self.host}:{self.port}") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(sock, sock.makefile("rb"))
        with self._lock:
            self._open.add(connection)
        return connection

    def _give(self, connection: _Connection) -> None:
        with self._lock:
            if connection in self._open:
                self._idle.append(connection)
                return
        connection.close()  # closed meanwhile (``close``)

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        with self._lock:
            self._open.discard(connection)

    def close(self) -> None:
        with self._lock:
            connections, self._open, self._idle = list(self._open), set(), []
        for connection in connections:
            connection.close()


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    rfile: BinaryIO

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


class Exchange:
    """A request on its way: ``response`` reads the answer once, on any thread, and hands the
    connection back for the next request (or drops it if the exchange failed)."""

    def __init__(self, owner: KeepAlive, connection: _Connection, method: str):
        self._owner, self._connection, self._method = owner, connection, method

    def response(self) -> Reply:
        connection, self._connection = self._connection, None
        if connection is None:
            raise RuntimeError("this exchange's response was read already")
        try:
            reply, closing = _read_response(connection.rfile, self._method)
        except TimeoutError as exc:
            self._owner._drop(connection)
            raise httpx.ReadTimeout(str(exc) or "timed out waiting for the response") from exc
        except _Malformed as exc:
            self._owner._drop(connection)
            raise httpx.RemoteProtocolError(str(exc)) from exc
        except (OSError, ValueError) as exc:  # ValueError: the socket's file was closed under the read
            self._owner._drop(connection)
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc
        if closing:
            self._owner._drop(connection)
        else:
            self._owner._give(connection)
        return reply

    def abandon(self) -> None:
        """Never read the answer: the connection is closed, not handed back mid-answer."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._owner._drop(connection)


def _header_lines(headers: Mapping[str, str]) -> str:
    lines = []
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n\0") or ":" in name:
            raise ValueError(f"header {name!r} would break the request")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


def _line(rfile: BinaryIO, what: str) -> bytes:
    line = rfile.readline(MAX_LINE + 1)
    if not line.endswith(b"\n"):
        raise _Malformed(f"{what} cut off" if len(line) <= MAX_LINE else f"{what} over {MAX_LINE} bytes")
    return line


def _read_response(rfile: BinaryIO, method: str) -> tuple[Reply, bool]:
    """(the response, whether the server closes the connection after it)."""
    while True:
        status_line = _line(rfile, "the status line")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
            raise _Malformed(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            line = _line(rfile, "the headers")
            if line in (b"\r\n", b"\n"):
                break
            name, colon, value = line.partition(b":")
            if not colon or len(headers) >= MAX_HEADERS:
                raise _Malformed(f"bad header line {line[:80]!r}" if not colon else f"over {MAX_HEADERS} headers")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if status >= 200:
            break  # 1xx: an interim response, the real one follows
    closing = headers.get("connection", "").lower() == "close" or parts[0] == b"HTTP/1.0"
    if method == "HEAD" or status in _NO_BODY:
        return Reply(status, headers, b""), closing
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Reply(status, headers, _chunked(rfile)), closing
    length = headers.get("content-length")
    if length is None or not length.isdigit():
        raise _Malformed("a response whose end only the connection's close would mark "
                         "(cut off in its headers, or not from a sidecar)")
    content = rfile.read(int(length))
    if len(content) != int(length):
        raise _Malformed(f"the body cut off at {len(content)} of {length} bytes")
    return Reply(status, headers, content), closing


def _chunked(rfile: BinaryIO) -> bytes:
    parts = []
    while True:
        size_line = _line(rfile, "a chunk's size").split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise _Malformed(f"bad chunk size {size_line[:20]!r}") from None
        if size == 0:
            while _line(rfile, "the trailers") not in (b"\r\n", b"\n"):
                pass
            return b"".join(parts)
        data = rfile.read(size + 2)
        if len(data) != size + 2 or not data.endswith(b"\r\n"):
            raise _Malformed("a chunk cut off")
        parts.append(data[:-2])


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle kept-alive socket is readable only if the server closed it (or broke protocol)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
