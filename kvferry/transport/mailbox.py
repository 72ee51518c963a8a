"""Where received bytes go: receives posted by tag (``Receive``), either in a ``Mailbox`` shared
by all connections of a listener (the receiver does not know which connection a sender will use;
the sender's RTS finds the receive, and announcements that came before their receive wait here),
or granted on one connection (``Connection.grant``: a credit). Nothing arrives that has no place
to go."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .buffers import Buffer
from .errors import CorruptPayload, TransportClosed, TransportTimeout
from .seal import Digest, Direction

if TYPE_CHECKING:
    from .connection import Connection


class Progress:
    """Payload bytes landed on one connection, and when the last of them landed. A receive bound
    to a connection waits its turn behind the others it carries: while the connection delivers,
    the receive is not stalled (a connection busy with 64 transfers over a slow link lands each
    chunk long after it was granted). ``reading``: the bytes of the payload being read now, which
    land only once whole (a backend does not say how much of a message is in): a receive waiting
    behind it is given the time they take at the floor rate (``Receive.wait``)."""

    __slots__ = ("landed", "at", "reading")

    def __init__(self) -> None:
        self.landed = 0
        self.at = time.monotonic()
        self.reading = 0

    def begin(self, n: int) -> None:
        """A payload of ``n`` bytes is being read: its header came, now."""
        self.reading = n
        self.at = time.monotonic()

    def land(self, n: int) -> None:
        self.landed += n
        self.at = time.monotonic()


class Receive:
    """A posted receive: the buffer a transfer with ``tag`` will be written into.

    ``wait`` returns the transfer's size once its last byte is in the buffer (checked, unless the
    consumer deferred the check: ``start_check``). It fails if neither the receive nor the
    connection carrying it (``carrier``, once it is bound to one) lands data for ``timeout``
    seconds, and, given a floor, if that connection delivers less than the floor on average.
    """

    def __init__(self, tag: int, buffer: Any, mailbox: Mailbox, defer_check: bool = False,
                 owner: dict[int, Receive] | None = None):
        self.tag = tag
        self._owner = owner  # the connection's receives, for one granted there: it leaves them when it ends
        self.buffer = Buffer(buffer, writable=True)
        # A device buffer's consumer may check the payload's CRCs itself, on its own stream with
        # its own work (``start_check``): the check then costs no wait of its own on the path.
        self.defer_check = defer_check and bool(getattr(buffer, "is_cuda", False))
        self._checks: list[tuple[int, int, Direction, int, bytes, bool]] = []
        self.total: int | None = None
        self.received = 0
        self._unacked = 0
        self._mailbox = mailbox
        self._future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._progress = time.monotonic()
        self.carrier: Progress | None = None  # the connection's, once bound to one (``bind``)
        self._carried = 0

    @property
    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout: float, min_rate: float = 0.0) -> int:
        """Bytes received, once all have landed.

        ``min_rate`` (bytes/s; 0: none): past ``timeout`` the receive also fails unless its
        connection delivered at least this much per second on average since the wait began, so
        a peer that drips a byte now and then cannot hold it open, while one that is busy with
        other transfers of the same connection can. A payload the connection is reading is given
        the time its bytes take at that rate on top (one message of a slow link may take longer
        than ``timeout`` to come in whole, and lands only then).

        Raises:
            TransportTimeout: no data for ``timeout`` seconds, or too little (the receive is cancelled).
            TransferRejected, PeerLost, ProtocolError, TransportClosed: as the transfer failed.
        """
        began, base = time.monotonic(), self._delivered()
        while not self._future.done():
            now = time.monotonic()
            carrier = self.carrier
            reading = carrier.reading / min_rate if carrier is not None and min_rate > 0 else 0.0
            stalled = max(self._progress, carrier.at if carrier is not None else 0.0) + timeout + reading
            landed = self._delivered() - base
            slow = began + timeout + landed / min_rate + reading if min_rate > 0 else stalled
            if now >= stalled:
                self.fail(TransportTimeout(f"transfer {self.tag:#x}: no data for {timeout:g} s"))
                break
            if now >= slow:
                self.fail(TransportTimeout(
                    f"transfer {self.tag:#x}: its connection delivered {landed} bytes in {now - began:.0f} s, "
                    f"under the floor of {min_rate / 2**20:g} MiB/s"))
                break
            # TransportTimeout is itself a TimeoutError: look at the future, not the exception.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(stalled, slow) - now):
                    await asyncio.shield(self._future)
        return self._future.result()

    def bind(self, carrier: Progress) -> None:
        """Count the bytes ``carrier`` (its connection's) lands as this receive's progress from now on."""
        self.carrier, self._carried = carrier, carrier.landed - self.received

    def _delivered(self) -> int:
        """Bytes landed into this receive, and once it is bound, on its connection since."""
        return self.received if self.carrier is None else self.carrier.landed - self._carried

    def start_check(self) -> Callable[[], None]:
        """For a ``defer_check`` receive, once ``wait`` returned: launch the checks of the bytes
        received on the current CUDA stream; the returned function raises ``CorruptPayload`` if
        any failed (it waits for the stream). Until it returns, the bytes are unverified."""
        pending = []
        for offset, length, direction, seq, tag, digest in self._checks:
            region = self.buffer.region(offset, offset + length)
            if digest:
                pending.append((offset, length, direction, seq, tag, direction.digest(region)))
            else:  # a host sender's payload into this GPU: its tag needs the bytes on the host
                pending.append((offset, length, direction, seq, tag, region.cpu().numpy()))

        def check() -> None:
            for offset, length, direction, seq, tag, value in pending:
                ok = (direction.check_digest(seq, value(), tag) if isinstance(value, Digest)
                      else direction.check_payload(seq, value, tag))
                if not ok:
                    raise CorruptPayload(f"transfer {self.tag:#x}: bytes [{offset}, {offset + length}) failed "
                                         "their authentication tag")

        return check

    def cancel(self) -> None:
        self.fail(TransportClosed(f"receive {self.tag:#x} cancelled"))

    def fail(self, exc: Exception) -> None:
        if not self._future.done():
            self._future.set_exception(exc)
            self._future.exception()  # retrieved: a receive nobody waits on must not warn
        self._mailbox._forget(self)
        if self._owner is not None and self._owner.get(self.tag) is self:
            del self._owner[self.tag]

    def _landed(self, n: int) -> None:
        self.received += n
        self._unacked += n
        self._progress = time.monotonic()
        if self.carrier is not None:
            self.carrier.land(n)

    def _finish(self) -> None:
        if not self._future.done():
            self._future.set_result(self.received)
        self._mailbox._forget(self)


class Mailbox:
    """Posted receives by tag, and announcements (RTS) that arrived before their receive."""

    def __init__(self, max_early: int = 4096, max_refused: int = 1 << 16):
        self._expected: dict[int, Receive] = {}
        self._early: dict[int, tuple[Connection, int]] = {}
        self._max_early = max_early
        self._refused: collections.OrderedDict[int, str] = collections.OrderedDict()  # oldest first
        self._max_refused = max_refused

    def refuse(self, tags: list[int], reason: str) -> None:
        """Reject transfers ``tags`` whether they were announced already or arrive later (the
        layer above refused what they belong to), so no sender waits on them."""
        for tag in tags:
            early = self._early.pop(tag, None)
            if early is not None:
                early[0]._reject(tag, reason)
            else:
                self._refused[tag] = reason
        while len(self._refused) > self._max_refused:
            self._refused.popitem(last=False)

    def expect(self, tag: int, buffer: Any, defer_check: bool = False) -> Receive:
        """Post a receive of transfer ``tag`` into ``buffer`` (host or CUDA, contiguous); with
        ``defer_check``, a CUDA buffer's payload CRCs are left to ``Receive.start_check``.

        Raises:
            ValueError: a receive for ``tag`` is already posted, or the buffer is not usable.
        """
        if tag in self._expected:
            raise ValueError(f"a receive for tag {tag:#x} is already posted")
        receive = Receive(tag, buffer, self, defer_check)
        self._expected[tag] = receive
        early = self._early.pop(tag, None)
        if early is not None:
            connection, total = early
            connection._accept(receive, total)
        return receive

    def _announce(self, connection: Connection, tag: int, total: int) -> None:
        refused = self._refused.pop(tag, None)
        if refused is not None:
            connection._reject(tag, refused)
            return
        receive = self._expected.get(tag)
        if receive is not None and receive.total is None:
            connection._accept(receive, total)
        elif receive is not None or tag in self._early:
            connection._reject(tag, f"transfer {tag:#x} is already in progress")
        elif len(self._early) >= self._max_early:
            connection._reject(tag, "too many transfers announced without a posted receive")
        else:
            self._early[tag] = (connection, total)

    def refusal(self, tag: int) -> str | None:
        """Why transfer ``tag`` was refused (``refuse``), once."""
        return self._refused.pop(tag, None)

    def _forget(self, receive: Receive) -> None:
        if self._expected.get(receive.tag) is receive:
            del self._expected[receive.tag]

    def _drop_connection(self, connection: Connection) -> None:
        for tag in [t for t, (c, _) in self._early.items() if c is connection]:
            del self._early[tag]
