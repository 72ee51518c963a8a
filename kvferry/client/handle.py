"""A typed handle on one transfer, the same whichever front end (REST or gRPC) started it.

``TransferStatus`` is a frozen snapshot of the sidecar's transfer record; ``Transfer`` (blocking)
and ``AsyncTransfer`` (asyncio) hold the last snapshot seen and fetch, wait for or cancel the
transfer through their client. A handle does I/O only in its methods: ``status`` and ``done``
read the last snapshot, so they cost nothing and never raise.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvferry.engine.errors import TransferFailed

TERMINAL = ("done", "failed", "cancelled")
STEP = 60.0  # the longest single long-poll a wait makes (the server takes up to 300 s)


@dataclass(frozen=True)
class TransferStatus:
    """One transfer's record as the sidecar answered it. A submit's first answer holds only
    ``id`` and ``state``; the other fields then keep their defaults."""

    id: str
    state: str
    direction: str = "out"
    peer: str = ""
    blocks: int = 0
    blocks_done: int = 0
    codec: str = "auto"
    chosen_codec: str = ""
    choice_reason: str = ""
    lossy: bool = False
    bytes_raw: int = 0
    bytes_wire: int = 0
    ratio: float | None = None
    seconds: float | None = None
    error: str | None = None
    error_kind: str | None = None
    created: float | None = None
    stages: Mapping[str, float] = field(default_factory=dict, compare=False)
    record: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the record as answered

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TransferStatus:
        """Parse the transfer JSON (``GET /v1/transfers/{id}``) or its gRPC equivalent."""
        known = {k: record[k] for k in cls.__dataclass_fields__ if k in record and k not in ("stages", "record")}
        return cls(**known, stages=dict(record.get("stages") or {}), record=dict(record))

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def ok(self) -> bool:
        return self.state == "done"


def settled(status: TransferStatus, expired: bool, timeout: float) -> bool:
    """True once done; False while it may still end within the deadline.

    Raises:
        TransferFailed: it failed or was cancelled, or is still going when ``expired``.
    """
    if status.ok:
        return True
    if status.terminal:
        raise TransferFailed(f"transfer {status.id} {status.state}: {status.error_kind}: {status.error}",
                             status.state, status.error_kind)
    if expired:
        raise TransferFailed(f"transfer {status.id} still {status.state} after {timeout:g} s", status.state)
    return False


Fetch = Callable[[str, float], TransferStatus]  # (id, long-poll seconds) -> snapshot
AsyncFetch = Callable[[str, float], Awaitable[TransferStatus]]


def waited(fetch: Fetch, transfer_id: str, timeout: float, status: TransferStatus | None = None) -> TransferStatus:
    """The snapshot once done, long-polling through ``fetch`` from ``status`` (None: not seen
    yet). Raises: TransferFailed (failed, cancelled, or not done within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        if status is None or not status.terminal:
            status = fetch(transfer_id, max(0.0, min(STEP, deadline - time.monotonic())))
        if settled(status, time.monotonic() >= deadline, timeout):
            return status


async def awaited(fetch: AsyncFetch, transfer_id: str, timeout: float,
                  status: TransferStatus | None = None) -> TransferStatus:
    """As ``waited``, for an asyncio client."""
    deadline = time.monotonic() + timeout
    while True:
        if status is None or not status.terminal:
            status = await fetch(transfer_id, max(0.0, min(STEP, deadline - time.monotonic())))
        if settled(status, time.monotonic() >= deadline, timeout):
            return status


class _Handle:
    def __init__(self, status: TransferStatus):
        self._status = status

    @property
    def id(self) -> str:
        return self._status.id

    @property
    def status(self) -> TransferStatus:
        """The last snapshot seen (no I/O: ``refresh`` or ``wait`` fetches a new one)."""
        return self._status

    @property
    def done(self) -> bool:
        """Whether the last snapshot seen is terminal (done, failed or cancelled)."""
        return self._status.terminal

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, {self._status.state!r})"


class Transfer(_Handle):
    """A transfer started by a blocking client (``Client.start``)."""

    def __init__(self, status: TransferStatus, fetch: Fetch, cancel: Callable[[str], TransferStatus]):
        super().__init__(status)
        self._fetch, self._cancel = fetch, cancel

    def refresh(self, wait: float = 0.0) -> TransferStatus:
        """Fetch the current snapshot; ``wait``: long-poll up to that many seconds for its end.
        Never raises for the transfer's state."""
        self._status = self._fetch(self.id, wait)
        return self._status

    def wait(self, timeout: float = 60.0) -> TransferStatus:
        """The snapshot once done (``status`` holds the last one seen whatever happens).

        Raises:
            TransferFailed: it failed or was cancelled, or is not done within ``timeout`` seconds.
        """
        return waited(lambda _, wait: self.refresh(wait), self.id, timeout, self._status)

    def cancel(self) -> TransferStatus:
        """Cancel it (the peer is told). Raises: Conflict (it had ended already)."""
        self._status = self._cancel(self.id)
        return self._status


class AsyncTransfer(_Handle):
    """A transfer started by an asyncio client (``AsyncClient.start``, ``GrpcClient.start``)."""

    def __init__(self, status: TransferStatus, fetch: AsyncFetch,
                 cancel: Callable[[str], Awaitable[TransferStatus]]):
        super().__init__(status)
        self._fetch, self._cancel = fetch, cancel

    async def refresh(self, wait: float = 0.0) -> TransferStatus:
        """As ``Transfer.refresh``."""
        self._status = await self._fetch(self.id, wait)
        return self._status

    async def wait(self, timeout: float = 60.0) -> TransferStatus:
        """As ``Transfer.wait``. Raises: TransferFailed."""
        return await awaited(lambda _, wait: self.refresh(wait), self.id, timeout, self._status)

    async def cancel(self) -> TransferStatus:
        """As ``Transfer.cancel``. Raises: Conflict."""
        self._status = await self._cancel(self.id)
        return self._status


class AsyncHandles:
    """Typed handles for an asyncio client of either front end: it provides ``transfer(id, wait)``
    and ``cancel(id)``, each answering a transfer's record."""

    async def handle(self, transfer_id: str) -> AsyncTransfer:
        """A handle on a transfer started elsewhere (its record fetched now). Raises: NotFound."""
        return self._handle(await self.transfer(transfer_id))

    def _handle(self, record: dict) -> AsyncTransfer:
        async def cancel(transfer_id: str) -> TransferStatus:
            return TransferStatus.from_record(await self.cancel(transfer_id))

        return AsyncTransfer(TransferStatus.from_record(record), self._snapshot, cancel)

    async def _snapshot(self, transfer_id: str, wait: float) -> TransferStatus:
        return TransferStatus.from_record(await self.transfer(transfer_id, wait))
