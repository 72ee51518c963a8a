"""Leases on regions: a region that lends a prefill's blocks to a decode, deleted by the sidecar
itself unless renewed (``seconds``), and at the latest ``ttl`` seconds after it was taken.

The decode renews a lease while its request waits in its queue (heartbeats), and deletes the
region once it pulled; the prefill's connector learns which leases ended by a long-poll
(``GET /v1/leases?after=G&wait=S`` answers once the book's generation passed ``G``), never by
polling. Expiry never deletes a region a transfer is reading: it retries once the transfer ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable

from pydantic import BaseModel, Field

from kvferry.engine.engine import Engine
from kvferry.engine.errors import Conflict, EngineError, NotFound

from .models import NAME

log = logging.getLogger("kvferry.api")

MAX_LEASE = 86400.0
MAX_WAIT = 30.0  # one long-poll's longest wait
RETRY = 0.5  # seconds between tries to delete an expired region a transfer still reads


class LeaseBody(BaseModel):
    seconds: float = Field(gt=0, le=MAX_LEASE, description="the lease ends this long from now unless renewed")
    ttl: float | None = Field(default=None, gt=0, le=MAX_LEASE,
                              description="on a new lease: it ends this long after it was taken, renewed or not")
    of: str | None = Field(default=None, pattern=NAME,
                           description="lease a new view of this region (its memory, under the lease's name): "
                                       "one call, nothing mapped again")


class RenewBody(BaseModel):
    names: list[Annotated[str, Field(pattern=NAME)]] = Field(min_length=1, max_length=4096)
    seconds: float = Field(gt=0, le=MAX_LEASE)


@dataclass
class Lease:
    expires: float  # renewed by heartbeats
    ends: float  # the TTL: never renewed past it


class LeaseBook:
    """The sidecar's leases, their expiry, and a generation that grows with each lease taken or ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.generation = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._engine: Engine | None = None

    def _bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def take(self, engine: Engine, name: str, seconds: float, ttl: float | None, of: str | None = None) -> dict[str, Any]:
        """Take or extend the lease on region ``name``; with ``of``, first create ``name`` as a
        view of region ``of`` unless it is one already.

        Raises: NotFound (no such region), Conflict (``name`` exists and is not a view of ``of``).
        """
        if of is None:
            region = engine.regions.get(name)
        else:
            try:
                region = engine.regions.get(name)
            except NotFound:
                region = engine.regions.view(name, of)
            if region.view_of != of:
                raise Conflict(f"region {name!r} exists and is not a view of {of!r}")
        if region.deleting:  # the delete would end the lease the moment it is taken
            raise Conflict(f"region {name!r} is being deleted")
        now = self.clock()
        lease = self.leases.get(name)
        if lease is None:
            lease = self.leases[name] = Lease(now, now + ttl if ttl else math.inf)
            self._bump()
        lease.expires = max(lease.expires, min(now + seconds, lease.ends))
        return self.describe(name)

    def renew(self, names: list[str], seconds: float) -> dict[str, list[str]]:
        """Extend the leases held among ``names`` (a heartbeat); the others are reported missing."""
        now, renewed, missing = self.clock(), [], []
        for name in names:
            lease = self.leases.get(name)
            if lease is None:
                missing.append(name)
                continue
            lease.expires = max(lease.expires, min(now + seconds, lease.ends))
            renewed.append(name)
        return {"renewed": renewed, "missing": missing}

    def forget(self, name: str) -> None:
        """The region is gone (deleted by its owner, the decode, or expiry)."""
        if self.leases.pop(name, None) is not None:
            self._bump()

    def describe(self, name: str | None = None) -> dict[str, Any]:
        now = self.clock()

        def one(lease: Lease) -> dict[str, float | None]:
            return {"expires_in": round(lease.expires - now, 3),
                    "ends_in": None if math.isinf(lease.ends) else round(lease.ends - now, 3)}

        if name is not None:
            return {"name": name, "generation": self.generation, **one(self.leases[name])}
        return {"generation": self.generation, "leases": {n: one(lease) for n, lease in self.leases.items()}}

    async def changes(self, after: int, wait: float) -> dict[str, Any]:
        """The leases, once the generation passed ``after`` or ``wait`` seconds passed."""
        if self.generation <= after and wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(wait, MAX_WAIT)):  # not wait_for: it can lose a cancellation
                    await self._changed.wait()
        return self.describe()

    # ---- expiry -------------------------------------------------------------------------------
    def start(self, engine: Engine) -> None:
        """Expire leases, and forget the lease of any region deleted, however it was deleted."""
        engine.regions.deleted.append(self.forget)
        self._engine = engine
        self._task = asyncio.get_running_loop().create_task(self._expire(engine), name="kvferry-leases")

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.regions.deleted.remove(self.forget)
            self._engine = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _expire(self, engine: Engine) -> None:
        while True:
            now = self.clock()
            due = [name for name, lease in self.leases.items() if lease.expires <= now]
            for name in due:
                lease = self.leases.get(name)
                if lease is None or lease.expires > self.clock():
                    continue  # renewed, or ended, while an earlier one's delete waited
                try:
                    await engine.delete_region(name)
                except NotFound:
                    self.forget(name)
                    continue
                except Conflict:
                    continue  # a transfer reads it: freed once it ended
                except EngineError as exc:  # noqa: PERF203
                    log.warning("lease %s expired but its region could not be deleted: %s", name, exc)
                    continue
                log.info("lease %s expired without a pull: region deleted", name)
            nearest = min((lease.expires for lease in self.leases.values()), default=now + 1.0)
            pause = RETRY if any(n in self.leases for n in due) else nearest - self.clock()
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                # Not ``wait_for``: on Python 3.11 a cancellation that comes as the event is set is
                # lost there, and this loop would never stop (a sidecar's shutdown would hang).
                async with asyncio.timeout(max(0.01, min(pause, 1.0))):
                    await changed.wait()
