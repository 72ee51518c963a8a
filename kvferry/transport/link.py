"""The interface every backend implements: an ordered, reliable message link between two peers,
and a listener that hands each new link to a callback. The protocol lives in connection.py; which
backend is used, in backends.py (this base imports none)."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvferry.transport")


class Link(ABC):
    """One connection as the protocol sees it: messages go out whole and in order."""

    peer: str

    @abstractmethod
    async def send(self, header: bytes, payload: Any = None) -> None:
        """Send a header and, if given, its payload region (host or device).

        Raises:
            PeerLost, TransportClosed.
        """

    def send_now(self, parts: list[Any]) -> list[Any]:
        """Write what of ``parts`` (headers and their payloads, in order, none empty) can be
        written without waiting; returns what is left for ``send_rest`` (every part, for
        backends that cannot write synchronously)."""
        return parts

    async def send_rest(self, parts: list[Any]) -> None:
        """Finish a write ``send_now`` began (the parts it returned, in order)."""
        for part in parts:
            await self.send(part)

    @abstractmethod
    async def recv_header(self, size: int) -> bytes:
        """Receive the next header of exactly ``size`` bytes.

        Raises:
            PeerLost, TransportClosed.
        """

    # Backends that move device payloads through host memory (TCP) say so: a host-checked payload
    # is then checked before it reaches the device, never deferred (a device digest still may be).
    stages_device_payloads = False
    # A byte stream (TCP) can be read a piece at a time; a message backend (UCX) delivers each
    # payload whole, into one buffer of its size.
    streams = True
    # Connections under this link that a large DATA payload is spread over (``Striped``).
    lanes = 1
    # A same-host shortcut (TCP's Unix socket): a dialler whose handshake fails on it dials the
    # backend's plain way instead.
    local = False

    @abstractmethod
    async def recv_payload(self, region: Any, check: Callable[[Any], bool] | None = None,
                           striped: bool = False) -> bool:
        """Receive exactly ``len(region)`` payload bytes into ``region`` (host or device); with
        ``check`` (the connection's verifier of these bytes, given the host bytes or the device
        tensor they landed in), False if they fail it (a region a backend stages is left
        untouched then). ``striped``: the sender sent it ``Striped``."""

    async def discard(self, nbytes: int, striped: bool = False) -> None:
        """Read and drop a payload of ``nbytes``."""
        scratch = bytearray(min(nbytes, 1 << 20))
        while nbytes:
            k = min(nbytes, len(scratch))
            await self.recv_payload(memoryview(scratch)[:k])
            nbytes -= k

    @abstractmethod
    async def close(self) -> None:
        """Release the link; pending operations on it fail."""


class Striped:
    """A DATA payload a link with lanes may spread over them (the receiver is told the same)."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any):
        self.payload = payload

    def __len__(self) -> int:
        return self.payload.numel() if hasattr(self.payload, "numel") else len(self.payload)


class ListenerHandle(ABC):
    port: int

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting connections."""


OnLink = Callable[[Link], Awaitable[None]]


class RateLimitedLog:
    """At most one warning a ``period`` for a repeated peer error, with how many were not
    logged: a peer cannot flood the log (a line per malformed message would be thousands a
    second)."""

    def __init__(self, logger: logging.Logger, period: float = 1.0):
        self._log = logger
        self._period = period
        self._last = -period
        self._dropped = 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self._period:
            self._dropped += 1
            return
        suffix = f" ({self._dropped} more like it not logged)" if self._dropped else ""
        self._log.warning("%s%s", message, suffix)
        self._last, self._dropped = now, 0
