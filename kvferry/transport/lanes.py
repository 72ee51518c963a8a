"""Several TCP connections ("lanes") under one link, for NICs faster than one TCP stream.

One TCP stream tops out where one core copies (3-4 GB/s), far below a 100-400 Gbit/s NIC. A
link dialled with ``tcp_lanes`` > 1 opens that many sockets. The first lane carries everything
it carries alone (the handshake, every header, small payloads), so a single-lane link is the
plain stream it always was. A large DATA payload (``dealt``) moves as slices that the sender's
lanes take from one cursor as each becomes free (``Dealer``), one worker thread per lane: TCP
streams that share a bottleneck get unequal, shifting shares of it, and a lane given a fixed
piece would leave the others idle until it ends. Slices shrink towards the payload's end so that
the lanes finish together. Each slice travels behind its own header; a lane ends its part of the
payload with an empty slice, so each receiving lane knows where the payload ends on it::

    offset size field
    0      8    offset of the slice in the payload (little-endian)
    8      4    its length; 0 = no more of this payload on this lane

The receiver (``Tally``) takes a slice only inside the payload, of at least ``MIN_SLICE`` bytes
unless it ends the payload, and never more bytes than the payload has; once every lane has ended,
the slices must tile the payload exactly.

Lanes are not authenticated by themselves: their bytes are payload bytes, which the message's
authenticated header covers (tag or device digest), wherever they arrived from.

Each lane opens with a preamble (before the handshake, which then runs on lane 0)::

    offset size field
    0      4    magic b"KVFL"
    4      1    version (2)
    5      1    this lane's index (0 ... count-1)
    6      1    lane count (2 ... 16)
    7      1    reserved, 0
    8      16   link id: random, the same on every lane of one link
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator

from .errors import ProtocolError

MAGIC = b"KVFL"
VERSION = 2
MAX_LANES = 16
PREAMBLE = struct.Struct("<4sBBBx16s")
# A DATA payload below this stays whole on lane 0: a piece per lane costs a thread hop each.
STRIPE_MIN = 4 << 20
SLICE = 16 << 20  # the largest slice a sender deals from host memory; the receiver takes any size
MIN_SLICE = 64 << 10  # the smallest a receiver takes, but for the payload's last
DEALT_FLOOR = 1 << 20  # the smallest a sender deals, but for the payload's last
SLICE_HEADER = struct.Struct("<QI")
# Lanes waiting for their link's lane 0 (``Gathering``): at most this many sockets, and from one
# address at most two links' worth.
MAX_WAITING_LANES = 256
MAX_WAITING_LANES_PER_SOURCE = 2 * (MAX_LANES - 1)


def pack_preamble(index: int, count: int, link_id: bytes) -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION, index, count, link_id)


def unpack_preamble(data: bytes) -> tuple[int, int, bytes]:
    """(lane index, lane count, link id) of a preamble.

    Raises:
        ProtocolError: not a preamble this side speaks, or an impossible lane.
    """
    magic, version, index, count, link_id = PREAMBLE.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a lane preamble of version {VERSION}")
    if not 2 <= count <= MAX_LANES or index >= count:
        raise ProtocolError(f"lane {index} of {count}: lanes are 2 to {MAX_LANES}")
    return index, count, link_id


def dealt(nbytes: int, lanes: int) -> bool:
    """Whether a DATA payload of ``nbytes`` is dealt over the lanes (else it stays on lane 0)."""
    return lanes > 1 and nbytes >= STRIPE_MIN


def slice_header(offset: int, size: int) -> bytes:
    return SLICE_HEADER.pack(offset, size)


def read_slice(read: Callable[[memoryview], None]) -> tuple[int, int] | None:
    """The next slice's (offset, size) on a lane whose bytes ``read`` fills views from; None at
    the lane's end of the payload."""
    header = bytearray(SLICE_HEADER.size)
    read(memoryview(header))
    offset, size = SLICE_HEADER.unpack(header)
    return (offset, size) if size else None


def arriving(read: Callable[[memoryview], None], tally: Tally | None, nbytes: int) -> Iterator[tuple[int, int]]:
    """The (offset, size) spans a receiving lane fills, in order: the whole ``nbytes`` payload
    where it is not dealt (no ``tally``), else each slice the lane carries, admitted by the tally
    before its bytes are read."""
    if tally is None:
        yield 0, nbytes
        return
    while (span := read_slice(read)) is not None:
        tally.take(*span)
        yield span


class Dealer:
    """The sender's cursor over one payload: each lane takes the next slice when it is free, so
    a lane the link favours carries more and none waits on a fixed share."""

    def __init__(self, nbytes: int, lanes: int, largest: int | None = None):
        self._nbytes = nbytes
        self._lanes = lanes
        self._largest = largest or SLICE
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int] | None:
        """(offset, size) of the next slice, or None once the payload is dealt. Near the end a
        slice is about a lane's share of what is left (at least ``DEALT_FLOOR``), so lanes end
        within a small slice of each other; smaller slices would cost more per byte than the
        lanes' difference (each is a header, a lock and, from a GPU, a staged copy)."""
        with self._lock:
            left = self._nbytes - self._next
            if left <= 0:
                return None
            size = min(self._largest, max(DEALT_FLOOR, -(-left // self._lanes)))
            size = min(left, -(-size // MIN_SLICE) * MIN_SLICE)
            offset = self._next
            self._next += size
            return offset, size


class Tally:
    """The receiver's account of one dealt payload: what a peer may send, and whether it sent
    exactly the payload. Shared by the receiving lanes' threads."""

    def __init__(self, nbytes: int):
        self._nbytes = nbytes
        self._got = 0
        self._slices: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def take(self, offset: int, size: int) -> None:
        """Admit a slice before its bytes are read.

        Raises:
            ProtocolError: outside the payload, too small, or more bytes than the payload has.
        """
        end = offset + size
        if end > self._nbytes:
            raise ProtocolError(f"a slice [{offset}, {end}) outside a {self._nbytes}-byte payload")
        if size < MIN_SLICE and end != self._nbytes:
            raise ProtocolError(f"a {size}-byte slice inside a payload (slices are at least {MIN_SLICE})")
        with self._lock:
            self._got += size
            if self._got > self._nbytes:
                raise ProtocolError(f"more slices than a {self._nbytes}-byte payload holds")
            self._slices.append((offset, size))

    def check_whole(self) -> None:
        """Once every lane has ended: the slices tile the payload, each byte once.

        Raises:
            ProtocolError: a gap or an overlap.
        """
        end = 0
        for offset, size in sorted(self._slices):
            if offset != end:
                raise ProtocolError(f"a dealt payload's slices {'overlap' if offset < end else 'leave a gap'} "
                                    f"at byte {min(offset, end)}")
            end += size
        if end != self._nbytes:
            raise ProtocolError(f"a dealt payload ended at byte {end} of {self._nbytes}")


class Gathering:
    """A listener's lanes waiting for the rest of their link: bounded in sockets and in time, so
    sockets that never make a link cost no more than their own descriptors, briefly. Lane 0
    awaits the others (inside its handshake's deadline and budget); the others are handed to it.

    Lanes 1... leave the handshake's budget as they are filed here, so they have their own: at
    most ``max_sockets`` wait, ``max_per_source`` from one address. When all are taken, a lane
    from an address holding fewer than the address holding the most closes that address's oldest
    group still without its lane 0 (fair shares, as for handshakes), else it is refused. A group
    not whole within ``timeout`` is closed by its own timer.
    """

    def __init__(self, timeout: float, max_sockets: int = MAX_WAITING_LANES,
                 max_per_source: int = MAX_WAITING_LANES_PER_SOURCE):
        self._timeout = timeout
        self._max_sockets = max_sockets
        self._max_per_source = max_per_source
        self._groups: dict[bytes, _Group] = {}
        self._held: Counter[str] = Counter()  # source -> its lanes 1... waiting here

    def add(self, link_id: bytes, index: int, count: int, sock: socket.socket, source: str = "") -> asyncio.Future:
        """File lane ``index`` of ``count`` from ``source``; the future gives lane 0 the sockets of
        lanes 1... once all are here.

        Raises:
            ProtocolError: a lane its group already has, a count or address that contradicts it,
                or one over the budget.
        """
        group = self._groups.get(link_id)
        if group is not None and (count != group.count or source != group.source or index in group.lanes
                                  or (index == 0 and group.has_first)):
            raise ProtocolError(f"lane {index} of {count} does not fit its link")
        if index:
            self._make_room(source)
        if group is None:
            group = self._groups[link_id] = _Group(count, source)
            group.timer = asyncio.get_running_loop().call_later(
                self._timeout, self._drop, link_id, "its other lanes did not arrive in time")
        if index:
            group.lanes[index] = sock
            self._held[source] += 1
        else:
            group.has_first = True
        if group.has_first and len(group.lanes) == count - 1:
            self._remove(link_id)
            if group.done.cancelled():
                group.close()  # lane 0 gave up meanwhile
            else:
                group.done.set_result([group.lanes[i] for i in range(1, count)])
        return group.done

    def _make_room(self, source: str) -> None:
        """Room for one more lane from ``source``.

        Raises:
            ProtocolError: none is made for it.
        """
        if self._held[source] >= self._max_per_source:
            raise ProtocolError(f"{self._held[source]} lanes from {source} wait for their links already")
        if sum(self._held.values()) < self._max_sockets:
            return
        heaviest = max(self._held.values())
        if self._held[source] < heaviest:
            for key, group in self._groups.items():  # oldest first
                if self._held[group.source] == heaviest and not group.has_first and group.lanes:
                    self._drop(key, "too many lanes waiting for their links")
                    return
        raise ProtocolError(f"{sum(self._held.values())} lanes wait for their links already")

    def _remove(self, link_id: bytes) -> _Group:
        group = self._groups.pop(link_id)
        if group.timer is not None:
            group.timer.cancel()
        self._held[group.source] -= len(group.lanes)
        if self._held[group.source] <= 0:
            del self._held[group.source]
        return group

    def _drop(self, link_id: bytes, why: str) -> None:
        if link_id in self._groups:
            self._remove(link_id).fail(why)

    def drain(self) -> None:
        """Close every waiting lane (the listener is closing)."""
        for link_id in list(self._groups):
            self._drop(link_id, "the listener closed")


class _Group:
    def __init__(self, count: int, source: str):
        self.count = count
        self.source = source
        self.timer: asyncio.TimerHandle | None = None
        self.lanes: dict[int, socket.socket] = {}
        self.has_first = False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def fail(self, why: str) -> None:
        self.close()
        if not self.done.done():
            self.done.set_exception(ProtocolError(why))
            self.done.exception()  # retrieved: lane 0 may never come to await it

    def close(self) -> None:
        for sock in self.lanes.values():
            sock.close()
