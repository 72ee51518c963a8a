"""Transfer records and their state machine: the legal transitions live here and nowhere else."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .errors import Conflict, NotFound, Overloaded


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


@dataclass
class Transfer:
    id: str
    direction: str  # "out" (this sidecar sends) or "in"
    src_region: str
    src_blocks: list[int]
    dst_region: str
    dst_blocks: list[int]
    peer: str
    codec: str  # what was asked: auto, splitzip, raw
    chosen_codec: str = ""
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    state: State = State.QUEUED
    bytes_raw: int = 0
    bytes_wire: int = 0
    blocks_done: int = 0
    error: str | None = None
    choice_reason: str = ""
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)

    def move(self, state: State, error: str | None = None) -> bool:
        """Go to ``state`` if legal; returns False (and changes nothing) from a terminal state."""
        if self.state == state:
            return False
        if state not in _LEGAL.get(self.state, set()):
            if self.state.terminal:
                return False
            raise ValueError(f"transfer {self.id}: {self.state.value} -> {state.value} is not legal")
        self.state = state
        if state == State.RUNNING:
            self.started = time.time()
        if state.terminal:
            self.finished = time.time()
            self.error = error
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def wait(self, timeout: float) -> None:
        """Until terminal or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not self.state.terminal:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    @property
    def seconds(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id, "direction": self.direction, "state": self.state.value,
            "src_region": self.src_region, "dst_region": self.dst_region, "peer": self.peer,
            "blocks": len(self.dst_blocks), "blocks_done": self.blocks_done,
            "codec": self.codec, "chosen_codec": self.chosen_codec, "choice_reason": self.choice_reason,
            "bytes_raw": self.bytes_raw, "bytes_wire": self.bytes_wire,
            "ratio": self.bytes_raw / self.bytes_wire if self.bytes_wire else None,
            "seconds": self.seconds, "error": self.error,
        }


class TransferTable:
    """Transfers by id. Finished ones are kept for queries, the oldest forgotten beyond
    ``history`` so a long-running daemon does not grow without bound."""

    def __init__(self, max_active: int, history: int = 4096):
        self._max_active = max_active
        self._history = history
        self._transfers: dict[str, Transfer] = {}  # insertion order = age

    def add(self, transfer: Transfer) -> Transfer:
        if transfer.id in self._transfers:
            raise Conflict(f"transfer {transfer.id} already exists")
        if self.active() >= self._max_active:
            raise Overloaded(f"{self._max_active} transfers are already in progress")
        self._transfers[transfer.id] = transfer
        if len(self._transfers) > self._history + self._max_active:
            finished = [tid for tid, t in self._transfers.items() if t.state.terminal]
            for tid in finished[: len(self._transfers) - self._history - self._max_active]:
                del self._transfers[tid]
        return transfer

    def active(self) -> int:
        return sum(not t.state.terminal for t in self._transfers.values())

    def get(self, transfer_id: str) -> Transfer:
        try:
            return self._transfers[transfer_id]
        except KeyError:
            raise NotFound(f"no transfer {transfer_id}") from None

    def query(self, state: str | None = None, direction: str | None = None) -> list[Transfer]:
        return [t for t in self._transfers.values()
                if (state is None or t.state.value == state) and (direction is None or t.direction == direction)]

    def all(self) -> list[Transfer]:
        return list(self._transfers.values())
