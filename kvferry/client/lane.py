"""The SDK's side of the control lane (``kvferry/engine/lane.py``): the transfer calls an engine
makes per request, framed in binary on kept-open sockets instead of HTTP. Same interface as the
lean HTTP client (``transport.KeepAlive``): ``send`` writes now, ``response`` reads on any thread,
and answers come back as ``Reply`` with the status and JSON body the REST API gives, so the SDK
treats both alike. Errors are httpx's, as there."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import httpx

from kvferry.engine import lane
from kvferry.engine.errors import PayloadTooLarge, ProtocolViolation

from .transport import Reply, closed_by_peer

_JSON = {"content-type": "application/json"}


class LaneKeepAlive:
    """Lane requests to one sidecar over kept-alive connections, one per request in flight (idle
    ones are reused by any thread); each connection says HELLO with the token once."""

    def __init__(self, host: str, port: int, token: str = ""):
        self.host, self.port, self._token = host, port, token
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._tags = itertools.count(1)

    def send(self, method: str, target: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
             timeout: float | None = None) -> LaneExchange:
        """Write the request now (``headers`` are HTTP's and not sent: the lane's body is JSON)."""
        tag = next(self._tags) & 0xFFFFFFFF
        try:
            frame = lane.pack(tag, lane.Request(method, target, body))
        except (ProtocolViolation, PayloadTooLarge) as exc:
            raise httpx.LocalProtocolError(str(exc)) from exc
        connection = self._take(timeout)
        if isinstance(connection, Reply):  # the sidecar refused the HELLO
            return LaneExchange(self, None, tag, connection)
        try:
            connection.sock.settimeout(timeout)
            connection.sock.sendall(frame)
        except TimeoutError as exc:
            self._drop(connection)
            raise httpx.WriteTimeout(str(exc) or "timed out sending the request") from exc
        except OSError as exc:
            self._drop(connection)
            raise httpx.WriteError(f"{type(exc).__name__}: {exc}") from exc
        return LaneExchange(self, connection, tag)

    def _take(self, timeout: float | None) -> _Connection | Reply:
        """An idle connection the sidecar has not closed, or a new one that it welcomed (or its
        refusal, a REPLY)."""
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                break
            if not closed_by_peer(connection.sock):
                return connection
            self._drop(connection)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or f"timed out connecting to {self.host}:{self.port}") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to the lane at {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(sock, sock.makefile("rb"))
        with self._lock:
            self._open.add(connection)
        try:
            sock.sendall(lane.pack(0, lane.Hello(self._token)))
            _, answer = _read(connection.rfile)
        except BaseException:
            self._drop(connection)
            raise
        if isinstance(answer, lane.Welcome):
            return connection
        self._drop(connection)
        if isinstance(answer, lane.Reply):
            return Reply(answer.status, _JSON, answer.body)
        raise httpx.RemoteProtocolError(f"the lane answered HELLO with {type(answer).__name__}")

    def _give(self, connection: _Connection) -> None:
        with self._lock:
            if connection in self._open:
                self._idle.append(connection)
                return
        connection.close()

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


class LaneExchange:
    """A lane request on its way: ``response`` reads its REPLY once, on any thread."""

    def __init__(self, owner: LaneKeepAlive, connection: _Connection | None, tag: int, refused: Reply | None = None):
        self._owner, self._connection, self._tag, self._refused = owner, connection, tag, refused

    def response(self) -> Reply:
        if self._refused is not None:
            return self._refused
        connection, self._connection = self._connection, None
        if connection is None:
            raise RuntimeError("this exchange's response was read already")
        try:
            tag, answer = _read(connection.rfile)
        except BaseException:
            self._owner._drop(connection)
            raise
        if not isinstance(answer, lane.Reply) or tag not in (self._tag, 0):
            self._owner._drop(connection)
            raise httpx.RemoteProtocolError(f"the lane answered with {type(answer).__name__} tag {tag}, "
                                            f"not a REPLY to {self._tag}")
        if tag == 0:  # the sidecar's refusal of the connection: it closes it
            self._owner._drop(connection)
        else:
            self._owner._give(connection)
        return Reply(answer.status, _JSON, answer.body)


def _read(rfile: BinaryIO) -> tuple[int, lane.Body]:
    """One frame, its errors as httpx's."""
    try:
        prefix = rfile.read(4)
        if len(prefix) != 4:
            raise httpx.ReadError("the sidecar closed the lane connection")
        size = lane.frame_size(prefix)
        frame = rfile.read(size)
        if len(frame) != size:
            raise httpx.ReadError(f"a lane frame cut off at {len(frame)} of {size} bytes")
        return lane.unpack(frame)
    except TimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "timed out waiting for the answer") from exc
    except (ProtocolViolation, PayloadTooLarge) as exc:
        raise httpx.RemoteProtocolError(str(exc)) from exc
    except OSError as exc:
        raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc
