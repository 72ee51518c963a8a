"""A sender's flow control: how a send learns the receiver has room (``Clearance``), each
transfer's state (``SendState``), the credits receivers grant it (``Credits``), the window of
bytes sent and not yet acknowledged (``Window``), the link emulator's pacing (``Pacer``), and a
device payload with its digest (``Digested``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import Iterable
from typing import Any

from .errors import TransportTimeout


class Clearance(enum.Enum):
    """How a send learns that the receiver has a buffer for it."""

    RENDEZVOUS = "rendezvous"  # it asks (RTS) and waits for the receiver's CTS
    CREDIT = "credit"  # the receiver's CTS comes unasked as it grants the buffer (``expect_credits`` first)
    INITIAL = "initial"  # granted already, in order on this connection (the protocol's initial credit): DATA at once


class Window:
    """Bytes sent and not yet acknowledged, bounded: senders wait for room. A sender waits as long
    as acknowledgements keep coming: behind many others on a busy connection its turn may come
    long after it began to wait, and the receiver was not silent meanwhile."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._changed = asyncio.Condition()
        self._error: Exception | None = None
        self._released = time.monotonic()  # the last acknowledgement

    def try_acquire(self, n: int) -> bool:
        """Take room at once if there is some (the common case: no task, no wait)."""
        if self._error is None and self.used + n <= self.capacity and not self._changed.locked():
            self.used += n
            return True
        return False

    async def acquire(self, n: int, timeout: float) -> None:
        """Take ``n`` bytes of room once there is some.

        Raises:
            TransportTimeout: nothing was acknowledged for ``timeout`` seconds while it waited.
        """
        began = time.monotonic()
        async with self._changed:
            while self._error is None and self.used + n > self.capacity:
                remaining = max(began, self._released) + timeout - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeout(f"receiver acknowledged nothing for {timeout:g} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
            if self._error is not None:
                raise self._error
            self.used += n

    async def release(self, n: int) -> None:
        async with self._changed:
            self.used = max(0, self.used - n)
            self._released = time.monotonic()
            self._changed.notify_all()

    async def fail(self, exc: Exception) -> None:
        async with self._changed:
            self._error = exc
            self._changed.notify_all()


class Pacer:
    """Sender-side pacing to a fixed rate: stands in for a slower link in benchmarks. A message's
    write is timed to end when a link of that rate, busy with the messages before it, would have
    delivered its last byte, so even a one-message transfer takes at least its size over the rate.

    The write itself (the loopback's own copy) is the link's serialization, not extra time: it is
    started that much early. Its duration is estimated from the fastest earlier write, so it never
    ends early; until one was measured a message waits for its whole serialization first, and a
    write that runs longer than estimated leaves the link idle meanwhile (both only ever slow the
    emulated link down)."""

    def __init__(self, bytes_per_s: float):
        self._rate = bytes_per_s
        self._free_at = time.monotonic()
        self._loopback = 0.0  # bytes per second of our fastest write (0: none measured yet)

    async def admit(self, n: int) -> None:
        now = time.monotonic()
        self._free_at = max(now, self._free_at) + n / self._rate
        lead = n / self._loopback if self._loopback else 0.0
        await asyncio.sleep(self._free_at - lead - now)

    def wrote(self, n: int, seconds: float) -> None:
        if seconds > 0:
            self._loopback = max(self._loopback, n / seconds)


class SendState:
    """One outgoing transfer: accepted (CTS) and done (the last ACK), bytes sent and acknowledged."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[int] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.sent = 0
        self.acked = 0

    def fail(self, exc: Exception) -> None:
        for future in (self.accepted, self.done):
            if not future.done():
                future.set_exception(exc)
                future.exception()


class Credits:
    """The credits a sender expects on one connection: tags the layer above said a receiver will
    grant (``expect``), each a future that the receiver's CTS settles with the buffer's size. A CTS
    for a tag not expected (a transfer ended here meanwhile, or a peer granting what nobody asked
    for) is dropped: it costs nothing."""

    def __init__(self) -> None:
        self._expected: dict[int, asyncio.Future[int]] = {}

    def expect(self, tags: Iterable[int]) -> None:
        loop = asyncio.get_running_loop()
        for tag in tags:
            if tag not in self._expected:
                self._expected[tag] = loop.create_future()

    def grant(self, tag: int, capacity: int) -> bool:
        future = self._expected.get(tag)
        if future is None or future.done():
            return False
        future.set_result(capacity)
        return True

    def take(self, tag: int) -> asyncio.Future[int] | None:
        return self._expected.pop(tag, None)

    def forget(self, tags: Iterable[int]) -> None:
        for tag in tags:
            future = self._expected.pop(tag, None)
            if future is not None:
                future.cancel()

    def fail(self, exc: Exception) -> None:
        for future in self._expected.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()
        self._expected.clear()


@dataclasses.dataclass(frozen=True)
class Digested:
    """A device payload with its digest computed (``Session.send.digest``)."""

    region: Any
    digest: bytes
