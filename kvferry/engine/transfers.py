"""Transfer records and their table; their phases and the moves between them are ``states.py``'s."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvferry import transport

from .errors import Conflict, NotFound, Overloaded
from .states import Phase, Side, State

if TYPE_CHECKING:
    from .blocks import Blocks
    from .links import Pair

log = logging.getLogger("kvferry.engine")
__all__ = ["STAGES", "State", "Transfer", "TransferSpec", "TransferTable", "peer_source"]
# Stages a transfer passes, in order; ``stages`` holds seconds since submit for each one reached.
STAGES = ("announced", "accepted", "first_byte", "last_byte", "done")


@dataclass(frozen=True)
class TransferSpec:
    """One transfer: the same blocks of every (source, destination) region pair, to ``peer``
    (the receiving sidecar's data address, ``host:port``)."""

    peer: str
    pairs: tuple[tuple[str, str], ...]
    src_blocks: Blocks
    dst_blocks: Blocks
    codec: str = "auto"
    codebook: str | None = None
    # Per pair, the (source, destination) regions holding a predictor's KV for the same blocks,
    # for codecs that code against it ("predictive"); None: no references.
    references: tuple[tuple[str, str], ...] | None = None
    # The id, where the submitter chose it (32 hex digits: a decode that waits on its own sidecar
    # for the transfer before the prefill's answer names it); None: one is drawn.
    transfer_id: str | None = None

    def raw_bytes(self, pairs: list[Pair]) -> int:
        """The KV bytes it moves: its blocks of every region pair."""
        return len(self.src_blocks) * sum(p.region.block_bytes for p in pairs)

    def measured_bytes(self, pairs: list[Pair]) -> int:
        """The bytes its time is a speed of for ``auto`` (``Policy.observe_transfer``): none where
        a codebook is used for the first time (``Pair.fresh_book``)."""
        return 0 if any(p.fresh_book for p in pairs) else self.raw_bytes(pairs)

    def destinations(self, pairs: list[Pair]) -> tuple[list[str], list[tuple[int, ...]], str]:
        """(destination region names, block shapes, dtype): what a lease must match."""
        return [dst for _, dst in self.pairs], [p.region.block_shape for p in pairs], pairs[0].region.dtype


@dataclass
class Transfer:
    id: str
    direction: str  # "out" (this sidecar sends) or "in"
    peer: str
    pairs: list[tuple[str, str]]  # (source region, destination region); the source is "" on the receiver
    blocks: int  # per pair
    codec: str  # what was asked: auto or a registered name
    chosen_codec: str = ""
    source: str = ""  # an incoming transfer's peer as its limit counts it (``peer_source``)
    choice_reason: str = ""
    lossy: bool = False  # the chosen codec changes the values (asked for by name, never by auto)
    references: list[str] = field(default_factory=list)  # regions of predictor KV this side reads
    state: State = State.QUEUED  # public: ``phase`` as the API reports it
    phase: Phase = Phase.QUEUED  # where its state machine is (``states.py``); moved by ``Driver.apply`` only
    bytes_raw: int = 0
    bytes_wire: int = 0
    blocks_done: int = 0
    error: str | None = None
    error_kind: str | None = None
    created: float = field(default_factory=time.time)
    submitted: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    _finished: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)  # None: an inline transfer, ended by callbacks
    # What ending it must release (posted receives, chunk tags, ...), whatever phase it ends in:
    # run once, by the state machine's ``Release`` (``Driver``).
    cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # A sender's way to start it again on a fresh connection, once (``Driver.lost``).
    redial: Callable[[], asyncio.Task] | None = field(default=None, repr=False)
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)  # an inline transfer's timeout

    @property
    def side(self) -> Side:
        return _SIDES[self.direction]  # a dict look-up: ``Side(...)`` costs microseconds per move

    def enter(self, phase: Phase, kind: str | None = None, reason: str | None = None) -> None:
        """Record the phase the state machine moved to (``Driver.apply``, nowhere else)."""
        self.phase, self.state = phase, phase.public
        if phase.terminal:
            self.finished_at = time.perf_counter()
            self.error, self.error_kind = reason, kind
            if phase == Phase.DONE:
                self.mark("done")
            self._finished.set()

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


_SIDES = {side.value: side for side in Side}


class TransferTable:
    """Transfers by id. Finished ones are kept for queries, the oldest forgotten beyond ``history``;
    every operation is O(1) so a long-running daemon does not slow down as its history fills.
    Transfers in progress are bounded per direction: peers' transfers into this sidecar
    (``max_incoming``) never crowd out its own (``max_active``), nor the other way round; and per
    peer (``max_incoming_per_peer``, by source address): one peer cannot take every incoming slot."""

    def __init__(self, max_active: int, history: int = 4096, max_incoming: int | None = None,
                 max_incoming_per_peer: int | None = None):
        self._max = {"out": max_active, "in": max_active if max_incoming is None else max_incoming}
        self._per_peer = self._max["in"] if max_incoming_per_peer is None else max_incoming_per_peer
        self._counts = {"out": 0, "in": 0}
        self._sources: Counter[str] = Counter()  # incoming transfers in progress per peer source
        self._history = history
        self._transfers: dict[str, Transfer] = {}
        self._active: dict[str, Transfer] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        # Told of each transfer added (queued) and each ended (retired by the driver, where every transfer ends), on the
        # event loop: a front end's push of transfer events (the gRPC Watch). Must not block.
        self.listeners: list[Callable[[Transfer], None]] = []
        self._arrivals: dict[str, list[asyncio.Future]] = {}  # id -> waiters for it to be added

    def add(self, transfer: Transfer) -> Transfer:
        """Raises: Conflict (id taken), Overloaded (too many in progress, in all or from its peer)."""
        if transfer.id in self._transfers:
            raise Conflict(f"transfer {transfer.id} already exists")
        direction = transfer.direction
        if self._counts[direction] >= self._max[direction]:
            what = "incoming transfers" if direction == "in" else "transfers"
            raise Overloaded(f"{self._max[direction]} {what} are already in progress")
        if direction == "in":
            source = transfer.source or transfer.peer
            if self._sources[source] >= self._per_peer:
                raise Overloaded(f"{self._per_peer} incoming transfers from {source} are already in progress "
                                 "(max_incoming_transfers_per_peer)")
            self._sources[source] += 1
        self._transfers[transfer.id] = self._active[transfer.id] = transfer
        self._counts[direction] += 1
        for waiter in self._arrivals.pop(transfer.id, ()):
            if not waiter.done():
                waiter.set_result(transfer)
        self._tell(transfer)
        return transfer

    async def arrival(self, transfer_id: str, timeout: float) -> Transfer | None:
        """Transfer ``transfer_id`` once it is here (a peer's announce admitted it), or None after
        ``timeout`` seconds: a decode waits on its own sidecar for a transfer it asked a prefill for."""
        found = self._transfers.get(transfer_id)
        if found is not None or timeout <= 0:
            return found
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._arrivals.setdefault(transfer_id, [])
        waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            return None
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters and self._arrivals.get(transfer_id) is waiters:
                del self._arrivals[transfer_id]

    def retire(self, transfer: Transfer) -> None:
        """Move a terminal transfer to the history, forgetting the oldest beyond its bound."""
        if self._active.pop(transfer.id, None) is not None:
            self._counts[transfer.direction] -= 1
            if transfer.direction == "in":
                source = transfer.source or transfer.peer
                self._sources[source] -= 1
                if not self._sources[source]:
                    del self._sources[source]
            self._finished[transfer.id] = None
            # The history keeps the record, not what could restart it (its spec's block lists);
            # its deadline was cancelled when it was released.
            transfer.redial = transfer.deadline = None
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


def peer_source(peer: str, connection_id: int) -> str:
    """What a peer's incoming transfers are counted under: the address of its ``host:port``, or its
    connection where the backend gives no address (ucxx)."""
    host = transport.peer_host(peer)
    return host if host is not None else f"connection {connection_id}"
