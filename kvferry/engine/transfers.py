"""Transfer records and their state machine: the legal transitions live here and nowhere else."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from collections.abc import Callable
from typing import Any

from .errors import Conflict, EngineError, NotFound, Overloaded

log = logging.getLogger("kvferry.engine")


class State(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (State.DONE, State.FAILED, State.CANCELLED)


_LEGAL = {
    State.QUEUED: {State.RUNNING, State.FAILED, State.CANCELLED},
    State.RUNNING: {State.DONE, State.FAILED, State.CANCELLED},
}
# Stages a transfer passes, in order; ``stages`` holds seconds since submit for each one reached.
STAGES = ("announced", "accepted", "first_byte", "last_byte", "done")


@dataclass
class Transfer:
    id: str
    direction: str  # "out" (this sidecar sends) or "in"
    peer: str
    pairs: list[tuple[str, str]]  # (source region, destination region); the source is "" on the receiver
    blocks: int  # per pair
    codec: str  # what was asked: auto or a registered name
    chosen_codec: str = ""
    choice_reason: str = ""
    lossy: bool = False  # the chosen codec changes the values (asked for by name, never by auto)
    references: list[str] = field(default_factory=list)  # regions of predictor KV this side reads
    state: State = State.QUEUED
    bytes_raw: int = 0
    bytes_wire: int = 0
    blocks_done: int = 0
    error: str | None = None
    error_kind: str | None = None
    created: float = field(default_factory=time.time)
    submitted: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    abort: tuple[str, str, str] | None = field(default=None, repr=False)  # (state, kind, reason) to end with
    _finished: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)  # None: an inline transfer, ended by callbacks
    # What ending it must release (posted receives, chunk tags, ...), whatever state it ends in:
    # run once by ``Engine.end``, the one place a transfer ends.
    cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # A sender's way to start it again on a fresh connection, once (``Engine.lost``).
    redial: Callable[[], asyncio.Task] | None = field(default=None, repr=False)
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)  # an inline transfer's timeout

    def move(self, state: State, error: str | None = None, kind: str | None = None) -> bool:
        """Go to ``state`` if legal; returns False (and changes nothing) from a terminal state.

        Raises:
            EngineError: an illegal move from a live state (a bug, not bad input).
        """
        if self.state == state:
            return False
        if state not in _LEGAL.get(self.state, set()):
            if self.state.terminal:
                return False
            raise EngineError(f"transfer {self.id}: {self.state.value} -> {state.value} is not legal")
        self.state = state
        if state.terminal:
            self.finished_at = time.perf_counter()
            self.error, self.error_kind = error, kind
            if state == State.DONE:
                self.mark("done")
            self._finished.set()
        return True

    def mark(self, stage: str) -> None:
        self.stages.setdefault(stage, time.perf_counter() - self.submitted)

    async def wait(self, timeout: float) -> bool:
        """Until terminal or ``timeout`` seconds pass; True if terminal."""
        if not self.state.terminal:
            try:
                async with asyncio.timeout(timeout):
                    await self._finished.wait()
            except TimeoutError:
                pass
        return self.state.terminal

    @property
    def seconds(self) -> float | None:
        return (self.finished_at or time.perf_counter()) - self.submitted

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id, "direction": self.direction, "state": self.state.value, "peer": self.peer,
            "regions": [{"src": s, "dst": d} for s, d in self.pairs],
            "src_region": self.pairs[0][0], "dst_region": self.pairs[0][1],
            "blocks": self.blocks * len(self.pairs), "blocks_done": self.blocks_done,
            "codec": self.codec, "chosen_codec": self.chosen_codec, "choice_reason": self.choice_reason,
            "lossy": self.lossy,
            "bytes_raw": self.bytes_raw, "bytes_wire": self.bytes_wire,
            "ratio": self.bytes_raw / self.bytes_wire if self.bytes_wire else None,
            "seconds": self.seconds, "stages": dict(self.stages), "error": self.error, "error_kind": self.error_kind,
            "created": self.created,
        }


class TransferTable:
    """Transfers by id. Finished ones are kept for queries, the oldest forgotten beyond ``history``;
    every operation is O(1) so a long-running daemon does not slow down as its history fills.
    Transfers in progress are bounded per direction: peers' transfers into this sidecar
    (``max_incoming``) never crowd out its own (``max_active``), nor the other way round."""

    def __init__(self, max_active: int, history: int = 4096, max_incoming: int | None = None):
        self._max = {"out": max_active, "in": max_active if max_incoming is None else max_incoming}
        self._counts = {"out": 0, "in": 0}
        self._history = history
        self._transfers: dict[str, Transfer] = {}
        self._active: dict[str, Transfer] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        # Told of each transfer added (queued) and each ended (retired by ``Engine.end``), on the
        # event loop: a front end's push of transfer events (the gRPC Watch). Must not block.
        self.listeners: list[Callable[[Transfer], None]] = []

    def add(self, transfer: Transfer) -> Transfer:
        """Raises: Conflict (id taken), Overloaded (too many in progress)."""
        if transfer.id in self._transfers:
            raise Conflict(f"transfer {transfer.id} already exists")
        direction = transfer.direction
        if self._counts[direction] >= self._max[direction]:
            what = "incoming transfers" if direction == "in" else "transfers"
            raise Overloaded(f"{self._max[direction]} {what} are already in progress")
        self._transfers[transfer.id] = self._active[transfer.id] = transfer
        self._counts[direction] += 1
        self._tell(transfer)
        return transfer

    def retire(self, transfer: Transfer) -> None:
        """Move a terminal transfer to the history, forgetting the oldest beyond its bound."""
        if self._active.pop(transfer.id, None) is not None:
            self._counts[transfer.direction] -= 1
            self._finished[transfer.id] = None
            while len(self._finished) > self._history:
                old, _ = self._finished.popitem(last=False)
                self._transfers.pop(old, None)
            self._tell(transfer)

    def _tell(self, transfer: Transfer) -> None:
        for listener in self.listeners:
            try:
                listener(transfer)
            except Exception:  # a listener's bug must not keep a transfer from starting or ending
                log.exception("a transfer listener failed on %s", transfer.id)

    def active(self, direction: str | None = None) -> list[Transfer]:
        return [t for t in self._active.values() if direction is None or t.direction == direction]

    def get(self, transfer_id: str) -> Transfer:
        try:
            return self._transfers[transfer_id]
        except KeyError:
            raise NotFound(f"no transfer {transfer_id}") from None

    def find(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def query(self, state: str | None = None, direction: str | None = None, limit: int = 1000) -> list[Transfer]:
        """Newest first."""
        out = []
        for t in reversed(self._transfers.values()):
            if (state is None or t.state.value == state) and (direction is None or t.direction == direction):
                out.append(t)
                if len(out) >= limit:
                    break
        return out

    def all(self) -> list[Transfer]:
        return list(self._transfers.values())
