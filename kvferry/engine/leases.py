"""Standing leases of same-host memory (peer protocol v3, NIXL's model of memory registered once).

A receiver on the same host lends a destination region's memory (CUDA IPC, or host shared
memory) in its ACCEPT; the lease stands for that connection. The sender then writes later
transfers into it at once and announces them with the WRITTEN flag behind the data: one message
and its DONE, where a first transfer needs ANNOUNCE → ACCEPT → WRITTEN → DONE. Before a receiver
lets a leased region go it sends REVOKE and waits for REVOKED, which the sender sends only once
no write of its own into that memory is under way; a sender that does not answer in time loses
the connection (it writes under a lease only while the connection it came on is open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvferry import transport

from . import peer

log = logging.getLogger("kvferry.engine")

# A receiver's refusal to lend a region may be passing (the region was being deleted, or its shared
# memory's name no longer named it, until it is registered anew): the sender offers again this long after.
OFFER_AGAIN_AFTER_S = 30.0


class Unconfirmed(NamedTuple):
    """A revocation's peers that did not confirm it, and the other regions lent to them."""

    peers: list[str]
    regions: list[str]


@dataclass
class Held:
    """A lease this sender holds: where the receiver's region lives and what its blocks are."""

    name: str
    target: peer.Target
    block_shape: tuple[int, ...]
    dtype: str
    writes: int = 0  # writes under way
    revoked: bool = False  # REVOKE came during a write: REVOKED goes after the last one
    gone: bool = False  # no longer held (taken back, lent anew, its connection lost): let go after the last write


class Leases:
    """Both sides' leases for one engine: those it holds as a sender, those it lent as a receiver."""

    def __init__(self, let_go: Callable[[bytes], None] = lambda handle: None) -> None:
        """``let_go``: called with a target's handle once no lease held names that memory and no
        write into it is under way (the sender unmaps it)."""
        self._let_go = let_go
        self._writing: Counter[bytes] = Counter()  # writes under way, by the handle of the memory written
        self._held: dict[transport.Connection, dict[str, Held]] = {}
        self._declined: dict[transport.Connection, dict[str, float]] = {}  # regions not lent, and since when
        self._no_events: set[transport.Connection] = set()  # receivers that cannot wait on our events
        self._lent: dict[str, set[transport.Connection]] = {}
        self._revoking: dict[tuple[transport.Connection, str], asyncio.Future] = {}

    # ---- sending ------------------------------------------------------------------------------
    def hold(self, connection: transport.Connection, helds: list[Held]) -> None:
        """Keep the targets a receiver lent on ``connection`` for later transfers."""
        if not connection.closed:
            table = self._held.setdefault(connection, {})
            declined = self._declined.get(connection, {})
            for held in helds:
                replaced = table.get(held.name)
                table[held.name] = held
                declined.pop(held.name, None)
                if replaced is not None and replaced is not held:
                    self._drop(replaced)

    def holding(self, connection: transport.Connection) -> bool:
        """Whether any lease is held on ``connection`` (the hot path's first, cheapest question)."""
        return bool(self._held.get(connection))

    def held(self, connection: transport.Connection, names: list[str], shapes: list[tuple[int, ...]],
             dtype: str) -> list[Held] | None:
        """The leases for every destination region named, if this connection holds them all and
        they hold blocks of the shape and dtype the transfer moves; else None."""
        table = self._held.get(connection)
        if not table:
            return None
        helds = [table.get(name) for name in names]
        if any(h is None or h.block_shape != shape or h.dtype != dtype for h, shape in zip(helds, shapes)):
            return None
        return helds  # type: ignore[return-value]

    def decline(self, connection: transport.Connection, names: list[str]) -> None:
        """The receiver answered an offer without lending (another host's, or memory it cannot
        share now): offer no more for these regions on this connection for ``OFFER_AGAIN_AFTER_S``."""
        if not connection.closed:
            now = time.monotonic()
            self._declined.setdefault(connection, {}).update((name, now) for name in names)

    def offer_wanted(self, connection: transport.Connection, names: list[str]) -> bool:
        """Whether to offer to write these regions ourselves: none of them declined on this
        connection in the last ``OFFER_AGAIN_AFTER_S`` (an older refusal is forgotten here)."""
        declined = self._declined.get(connection)
        if not declined:
            return True
        now = time.monotonic()
        for name in names:
            since = declined.get(name)
            if since is not None:
                if now - since < OFFER_AGAIN_AFTER_S:
                    return False
                del declined[name]
        return True

    def refuse_events(self, connection: transport.Connection) -> None:
        """The receiver cannot open this sidecar's CUDA events (it asked for WRITTEN instead):
        writes on ``connection`` are announced once finished from now on."""
        if not connection.closed:
            self._no_events.add(connection)

    def waits_on_events(self, connection: transport.Connection) -> bool:
        return connection not in self._no_events

    @contextlib.contextmanager
    def writing(self, connection: transport.Connection, helds: list[Held]) -> Iterator[None]:
        """A write under ``helds``: a REVOKE that comes meanwhile is answered once it is over."""
        self.begin(helds)
        try:
            yield
        finally:
            self.end(connection, helds)

    def begin(self, helds: list[Held]) -> None:
        for held in helds:
            held.writes += 1
            self._writing[held.target.handle] += 1

    def end(self, connection: transport.Connection, helds: list[Held]) -> None:
        """A write under these leases is over: answer a REVOKE that waited for it."""
        for held in helds:
            held.writes -= 1
            self._writing[held.target.handle] -= 1
            if not self._writing[held.target.handle]:
                del self._writing[held.target.handle]
            if held.revoked and held.writes == 0:
                held.revoked = False
                _post(connection, peer.Revoked(held.name))
            if held.gone:
                self._drop(held)

    def in_use(self) -> set[bytes]:
        """The handles of memory a lease held names or a write runs into: what the sender must keep
        mapped (a mapping let go under a running copy faults the sender's GPU). Asked from the
        threads that write, while the loop changes the tables: each is copied whole first (one
        step under the GIL) rather than iterated as it changes."""
        handles = set(list(self._writing))
        for table in list(self._held.values()):
            handles.update(h.target.handle for h in list(table.values()))
        return handles

    def on_revoke(self, connection: transport.Connection, name: str) -> None:
        """The receiver takes a lease back: no new write starts; REVOKED once none is under way."""
        held = self._held.get(connection, {}).pop(name, None)
        if held is not None and held.writes:
            held.revoked = True
        else:
            _post(connection, peer.Revoked(name))
        if held is not None:
            self._drop(held)

    def _drop(self, held: Held) -> None:
        """``held`` is held no more: once no write into its memory is under way (under any lease),
        and no lease still held names that memory, it is let go."""
        held.gone = True
        handle = held.target.handle
        if self._writing.get(handle) or any(h.target.handle == handle for table in self._held.values()
                                            for h in table.values()):
            return  # a write under another lease of the same memory (another connection's) lets it go
        self._let_go(handle)

    # ---- receiving ----------------------------------------------------------------------------
    def lend(self, name: str, connection: transport.Connection) -> None:
        self._lent.setdefault(name, set()).add(connection)

    def lent_to(self, name: str, connection: transport.Connection) -> bool:
        return connection in self._lent.get(name, ())

    def revoking(self, name: str, connection: transport.Connection) -> bool:
        """Whether region ``name`` is being taken back from ``connection``: REVOKE sent, REVOKED not
        come (the memory stays lent until then; a write announced meanwhile crossed the REVOKE)."""
        return (connection, name) in self._revoking

    async def revoke(self, name: str, timeout: float) -> Unconfirmed:
        """Take back every lease of region ``name``. Returns the peers that did not confirm within
        ``timeout`` seconds (their connections are closed, but a sender stopped mid-write may
        still finish that write: the caller must not reuse the memory), with the other regions
        lent to them, which the same stopped sender may be writing too; no peers: no sender
        writes into it any more."""
        connections = [c for c in self._lent.pop(name, ()) if not c.closed]
        if not connections:
            return Unconfirmed([], [])
        silent, others = [], []
        loop = asyncio.get_running_loop()
        waits = {}
        for connection in connections:
            waits[connection] = self._revoking[(connection, name)] = loop.create_future()
            _post(connection, peer.Revoke(name))
        try:
            _, late = await asyncio.wait(waits.values(), timeout=timeout)
            for connection, future in waits.items():
                if future in late:
                    log.warning("peer %s did not give back its lease of region %r within %g s: closing the connection",
                                connection.peer, name, timeout)
                    silent.append(connection.peer)
                    others += [other for other, holders in self._lent.items() if connection in holders]
                    await connection.close()
        finally:
            for connection in connections:
                self._revoking.pop((connection, name), None)
        return Unconfirmed(silent, sorted(set(others)))

    def on_revoked(self, connection: transport.Connection, name: str) -> bool:
        """A sender's REVOKED; False if no revocation of that region on that connection waits."""
        future = self._revoking.get((connection, name))
        if future is None or future.done():
            return False
        future.set_result(None)
        return True

    # ---- both ---------------------------------------------------------------------------------
    def lost(self, connection: transport.Connection) -> None:
        """A connection is gone: its leases with it (a closed connection carries no more writes)."""
        for held in self._held.pop(connection, {}).values():
            self._drop(held)
        self._declined.pop(connection, None)
        self._no_events.discard(connection)
        for holders in self._lent.values():
            holders.discard(connection)
        for (c, _), future in list(self._revoking.items()):
            if c is connection and not future.done():
                future.set_result(None)


def _post(connection: transport.Connection, body: peer.Revoke | peer.Revoked) -> None:
    if not connection.closed:
        connection.post_message(peer.pack(peer.Message(peer.LINK_ID, body)))
