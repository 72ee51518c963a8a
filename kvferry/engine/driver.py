"""The narrow context between a transfer's state machine (``states.py``) and the world: ``apply``
steps the machine and executes its actions (release what the transfer holds, tell the peer,
finish it), with only what those need (the transfer table, the peer links, metrics, regions),
not the engine. The one place a transfer's phase changes, and so the one place it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvferry import transport

from . import peer
from .errors import NotFound, PeerError
from .links import LinkTable, PeerLink
from .metrics import Metrics
from .regions import RegionTable
from .states import Event, Finish, On, Phase, Release, Tell, step
from .transfers import Transfer, TransferTable

log = logging.getLogger("kvferry.engine")


class Driver:
    """Runs every transfer's state machine for one engine."""

    def __init__(self, transfers: TransferTable, links: LinkTable, metrics: Metrics, regions: RegionTable):
        self.transfers, self.links, self.metrics, self.regions = transfers, links, metrics, regions
        # Called with (transfer, the phase it left) after every change of phase.
        self.watchers: list[Callable[[Transfer, Phase], None]] = []

    def apply(self, t: Transfer, event: Event) -> bool:
        """Step ``t``'s machine with ``event`` and do what the move asks. False where nothing
        changed: a terminal transfer absorbs every event, and a chunk keeps it where it is.

        Raises:
            IllegalMove: an event of this sidecar's own that the transfer's phase does not expect.
        """
        before = t.phase
        after, actions = step(t.side, before, event)
        if after == before:
            return False
        finish = actions[-1] if actions else None
        if isinstance(finish, Finish):
            t.enter(after, finish.kind, finish.reason)
        else:
            t.enter(after)
        try:
            for action in actions:
                if isinstance(action, Release):
                    self._release(t)
                elif isinstance(action, Tell):
                    self._tell(t, action)
        finally:
            if finish is not None:
                self._finish(t)
            for watcher in self.watchers:
                try:
                    watcher(t, before)
                except Exception:  # a watcher's failure is not the transfer's
                    log.exception("a watcher of transfer %s failed", t.id)
        return True

    def cancel(self, t: Transfer, kind: str, reason: str) -> bool:
        return self.apply(t, Event(On.CANCEL, kind, reason))

    def fail(self, t: Transfer, kind: str, reason: str, on: On = On.FAIL) -> bool:
        return self.apply(t, Event(on, kind, reason))

    def lost(self, t: Transfer, link: PeerLink, exc: Exception) -> None:
        """A transfer's connection failed: whichever side waits fails at once. A sender's pooled
        connection that was dead already (its peer restarted unseen: a reset at first use) before
        the peer said anything of this transfer is not its failure: it is sent again, once, on a
        fresh connection (nothing of it reached the peer's new process)."""
        if not self._redial(t, link, exc):
            self.fail(t, "PeerError", f"lost the peer: {type(exc).__name__}: {exc}", On.LOST)
        settle(link, error=PeerError(f"lost the peer: {type(exc).__name__}: {exc}"))

    def _redial(self, t: Transfer, link: PeerLink, exc: Exception) -> bool:
        if (t.direction != "out" or t.state.terminal or t.redial is None or not link.reused
                or link.accepted.done() or link.reply.done() or not isinstance(exc, transport.PeerLost)):
            return False
        restart, t.redial = t.redial, None
        self.links.drop(t)
        if t.deadline is not None:
            t.deadline.cancel()
            t.deadline = None
        self.apply(t, Event(On.REDIAL))
        log.info("transfer %s: the pooled connection to %s was dead (%s): sending it again on a fresh one",
                 t.id, t.peer, exc)
        old, t.task = t.task, restart()
        if old is not None and not old.done():
            old.cancel()
        return True

    def _release(self, t: Transfer) -> None:
        if t.deadline is not None:
            t.deadline.cancel()
        cleanups, t.cleanups = t.cleanups, []
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception:  # one failed release must not keep the others held
                log.exception("releasing transfer %s failed", t.id)
        names = [d for _, d in t.pairs] if t.direction == "in" else [s for s, _ in t.pairs]
        task = t.task
        if task is not None and not task.done() and task is not _current_task():
            # Its task, cancelled by the Finish that follows, may be waiting for a worker thread or
            # the GPU, which go on reading or writing the regions: they stay busy until it ends.
            task.add_done_callback(lambda _: self._free(t, names + t.references))
        else:
            self._free(t, names + t.references)

    def _free(self, t: Transfer, names: list[str]) -> None:
        for name in names:
            try:  # the region may be deleted again once no transfer uses it
                self.regions.get(name).busy.discard(t.id)
            except NotFound:
                pass

    def _tell(self, t: Transfer, tell: Tell) -> None:
        """Best effort: the peer learns why we stopped (it times out on its own otherwise)."""
        if tell.message == "done":
            body: peer.Done | peer.Cancel | peer.Error = peer.Done(t.blocks_done, t.bytes_raw, t.bytes_wire)
        elif tell.message == "error":
            body = peer.Error(tell.kind or "EngineError", tell.reason or "")
        else:
            body = peer.Cancel(tell.reason or "")
        link = self.links.get(t.id)
        if link is not None and not link.connection.closed:
            link.connection.post_message(peer.pack(peer.Message(t.id, body)))

    def _finish(self, t: Transfer) -> None:
        """Bookkeeping once ``t`` is terminal (history, metrics), its link dropped and its task,
        if another one, cancelled."""
        try:
            self.transfers.retire(t)
            state, kind = t.state, t.error_kind
            self.metrics.finished(state.value, t.direction, t.chosen_codec, t.bytes_raw, t.bytes_wire, t.seconds)
            if t.lossy and t.phase == Phase.DONE:
                self.metrics.lossy_bytes.labels(t.direction, t.chosen_codec).inc(t.bytes_raw)
            if t.phase == Phase.FAILED:
                self.metrics.errors.labels(kind or "EngineError").inc()
        finally:
            self.links.drop(t)
            task = t.task
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


def settle(link: PeerLink, done: peer.Done | None = None, error: Exception | None = None) -> None:
    """Set a link's reply once: the peer's DONE, or why there will be none."""
    if link.reply.done():
        return
    if error is None:
        link.reply.set_result(done)
    else:
        link.reply.set_exception(error)
        link.reply.exception()  # retrieved: a receiver's link has nobody awaiting it
    if link.settle is not None:
        link.settle(link.reply)
