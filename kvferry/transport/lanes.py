"""Several TCP connections ("lanes") under one link, for NICs faster than one TCP stream.

One TCP stream tops out where one core copies (3-4 GB/s), far below a 100-400 Gbit/s NIC. A
link dialled with ``tcp_lanes`` > 1 opens that many sockets. The first lane carries everything
it carries alone (the handshake, every header, small payloads), so a single-lane link is the
plain stream it always was. A large DATA payload is cut into one piece per lane
(``stripes``) and the pieces move at once, one worker thread per lane. Both ends cut the same
way from the payload's length and the lane count, and every lane carries its pieces in message
order, so no piece needs a header of its own.

Lanes are not authenticated by themselves: their bytes are payload bytes, which the message's
authenticated header covers (tag or device digest), wherever they arrived from.

Each lane opens with a preamble (before the handshake, which then runs on lane 0)::

    offset size field
    0      4    magic b"KVFL"
    4      1    version (1)
    5      1    this lane's index (0 ... count-1)
    6      1    lane count (2 ... 16)
    7      1    reserved, 0
    8      16   link id: random, the same on every lane of one link
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from .errors import ProtocolError

MAGIC = b"KVFL"
VERSION = 1
MAX_LANES = 16
PREAMBLE = struct.Struct("<4sBBBx16s")
# A DATA payload below this stays whole on lane 0: a piece per lane costs a thread hop each.
STRIPE_MIN = 4 << 20
_PIECE_ALIGN = 64 << 10


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


def stripes(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, size) of each lane's piece of an ``nbytes`` payload, lane 0 first; fewer than
    ``lanes`` pieces where the payload is small (one, below ``STRIPE_MIN``)."""
    if lanes <= 1 or nbytes < STRIPE_MIN:
        return [(0, nbytes)]
    piece = -(-nbytes // lanes)
    piece = -(-piece // _PIECE_ALIGN) * _PIECE_ALIGN
    return [(offset, min(piece, nbytes - offset)) for offset in range(0, nbytes, piece)]


class Gathering:
    """A listener's lanes waiting for the rest of their link: bounded in groups and in time, so
    sockets that never make a link cost no more than their own descriptors, briefly. Lane 0
    awaits the others (inside its handshake's deadline); the others are handed to it."""

    def __init__(self, timeout: float, max_groups: int = 64):
        self._timeout = timeout
        self._max_groups = max_groups
        self._groups: dict[bytes, _Group] = {}

    def add(self, link_id: bytes, index: int, count: int, sock: socket.socket) -> asyncio.Future:
        """File lane ``index`` of ``count``; the future gives lane 0 the sockets of lanes 1...
        once all are here.

        Raises:
            ProtocolError: a lane its group already has, or a count that contradicts it.
        """
        now = time.monotonic()
        for key in [key for key, group in self._groups.items() if now - group.born > self._timeout]:
            self._groups.pop(key).fail("its other lanes did not arrive in time")
        group = self._groups.get(link_id)
        if group is None:
            if len(self._groups) >= self._max_groups:
                self._groups.pop(next(iter(self._groups))).fail("too many links waiting for their lanes")
            group = self._groups[link_id] = _Group(now, count)
        if count != group.count or index in group.lanes or (index == 0 and group.has_first):
            raise ProtocolError(f"lane {index} of {count} does not fit its link")
        if index:
            group.lanes[index] = sock
        else:
            group.has_first = True
        if group.has_first and len(group.lanes) == count - 1:
            del self._groups[link_id]
            if group.done.cancelled():
                group.close()  # lane 0 gave up meanwhile
            else:
                group.done.set_result([group.lanes[i] for i in range(1, count)])
        return group.done

    def drain(self) -> None:
        """Close every waiting lane (the listener is closing)."""
        for group in self._groups.values():
            group.fail("the listener closed")
        self._groups.clear()


class _Group:
    def __init__(self, born: float, count: int):
        self.born = born
        self.count = count
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
