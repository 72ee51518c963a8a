"""Transfer events for the gRPC Watch: the engine's transfer table tells the hub of each transfer
added and ended (``TransferTable.listeners``), and the hub hands each watcher the latest state
of each transfer it watches.

Bounded: a watcher holds at most one unread event per transfer (a newer state replaces an unread
older one, so a slow reader skips intermediate states but never the end) and falls at most
``MAX_BEHIND`` transfers behind; past that it is marked overflowed and its stream ends with
RESOURCE_EXHAUSTED, and the client resubscribes (which resends every current state). Everything
runs on the event loop: subscribing takes the snapshot and registers in one step, so no event
between a Submit and a Watch is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvferry.engine.errors import BadRequest, Overloaded
from kvferry.engine.transfers import Transfer, TransferTable

MAX_WATCHERS = 256  # Watch streams at once
MAX_BEHIND = 1024  # transfers with an unread event, per watcher
MAX_IDS = MAX_BEHIND  # transfer ids one Watch names (their snapshots must fit)
MAX_ENDED_TAGS = 4096  # submitters of ended transfers kept for catch-up (the table's default history)


@dataclass(frozen=True)
class Event:
    kind: str  # "snapshot", "changed" or "not_found"
    id: str
    record: dict[str, Any] | None  # the transfer's record at the time; None when not found


class Watcher:
    """One Watch stream's selection and its unread events."""

    def __init__(self, ids: frozenset[str] | None, submitter: str, follow: bool):
        self.ids, self.submitter, self.follow = ids, submitter, follow
        self.unread: OrderedDict[str, Event] = OrderedDict()
        self.open: set[str] = set()  # watched transfers that have not ended
        self.wake = asyncio.Event()
        self.overflowed = False
        self.closed = False  # the sidecar is shutting down

    def selects(self, transfer_id: str, tag: str) -> bool:
        if self.ids is not None:
            return transfer_id in self.ids
        return not self.submitter or tag == self.submitter

    def push(self, event: Event) -> None:
        self.unread.pop(event.id, None)  # the newest state only, in the order of the changes
        self.unread[event.id] = event
        if event.kind == "not_found" or (event.record is not None and event.record["state"] in _TERMINAL):
            self.open.discard(event.id)
        else:
            self.open.add(event.id)
        if len(self.unread) > MAX_BEHIND:
            self.overflowed = True
        self.wake.set()

    def drain(self) -> list[Event]:
        events = list(self.unread.values())
        self.unread.clear()
        self.wake.clear()
        return events

    @property
    def finished(self) -> bool:
        """Without ``follow``: every watched transfer has ended and its end was read."""
        return not self.follow and not self.open and not self.unread


_TERMINAL = ("done", "failed", "cancelled")


class Hub:
    """The watchers of one engine's transfers."""

    def __init__(self, table: TransferTable):
        self._table = table
        self._watchers: set[Watcher] = set()
        self._own = 0  # streams that watch one transfer on the transfer itself (``held``)
        self._tags: dict[str, str] = {}  # transfer id -> its submitter, while it is in progress
        self._ended: OrderedDict[str, str] = OrderedDict()  # ... and for the latest MAX_ENDED_TAGS ended
        table.listeners.append(self._changed)

    def subscribe(self, ids: list[str], submitter: str, follow: bool, since: float = 0.0) -> Watcher:
        """A watcher holding the current state of each transfer it selects: those ``ids``, or
        those in progress and, with ``since``, those created since then that have ended already
        (the newest that fit in ``MAX_BEHIND``).

        Raises:
            BadRequest: too many ids. Overloaded: too many watchers.
        """
        if len(ids) > MAX_IDS:
            raise BadRequest(f"a Watch names at most {MAX_IDS} transfers, not {len(ids)}")
        self._check_room()
        watcher = Watcher(frozenset(ids) if ids else None, submitter, follow)
        if ids:
            found = [(i, self._table.find(i)) for i in dict.fromkeys(ids)]
        else:
            found = [(t.id, t) for t in self._table.active() if watcher.selects(t.id, self._tag_of(t.id))]
            if since > 0:
                ended = [t for t in self._table.query(limit=MAX_BEHIND - len(found))
                         if t.created >= since and t.state.terminal and watcher.selects(t.id, self._tag_of(t.id))]
                found = [(t.id, t) for t in reversed(ended)] + found
        for transfer_id, t in found:
            watcher.push(Event("snapshot", transfer_id, t.public()) if t is not None
                         else Event("not_found", transfer_id, None))
        self._watchers.add(watcher)
        return watcher

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A Watch stream that awaits one transfer itself, not through the hub: counted with the
        hub's watchers all the same, so no kind of stream escapes ``MAX_WATCHERS``.

        Raises:
            Overloaded: too many streams.
        """
        self._check_room()
        self._own += 1
        try:
            yield
        finally:
            self._own -= 1

    def _check_room(self) -> None:
        if len(self._watchers) + self._own >= MAX_WATCHERS:
            raise Overloaded(f"{MAX_WATCHERS} Watch streams are open already")

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def tag(self, t: Transfer, submitter: str) -> None:
        """Mark ``t`` (just submitted) as ``submitter``'s, telling the watchers of that submitter."""
        if not submitter:
            return
        if not t.state.terminal:
            self._tags[t.id] = submitter
        self._tell(t, submitter, lambda w: w.submitter == submitter and w.ids is None)

    def close(self) -> None:
        """End every stream (the sidecar shuts down): each tells its client to come back."""
        if self._changed in self._table.listeners:
            self._table.listeners.remove(self._changed)
        for watcher in self._watchers:
            watcher.closed = True
            watcher.wake.set()

    def _tag_of(self, transfer_id: str) -> str:
        return self._tags.get(transfer_id) or self._ended.get(transfer_id, "")

    def _changed(self, t: Transfer) -> None:
        tag = self._tags.pop(t.id, "") if t.state.terminal else self._tags.get(t.id, "")
        if tag and t.state.terminal:
            self._ended[t.id] = tag
            while len(self._ended) > MAX_ENDED_TAGS:
                self._ended.popitem(last=False)
        self._tell(t, tag, lambda w: True)

    def _tell(self, t: Transfer, tag: str, also: Callable[[Watcher], bool]) -> None:
        record = None
        for watcher in self._watchers:
            if watcher.selects(t.id, tag) and also(watcher):
                record = record or t.public()
                watcher.push(Event("changed", t.id, record))
