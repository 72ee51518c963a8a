"""The Watch hub on a real transfer table, no sidecar: snapshots, pushed changes, coalescing of
unread states, and its bounds."""

from __future__ import annotations

import contextlib

import pytest

from kvferry.api.grpc.watch import MAX_BEHIND, MAX_IDS, Hub
from kvferry.engine.errors import BadRequest
from kvferry.engine.states import Phase
from kvferry.engine.transfers import State, Transfer, TransferTable


def _transfer(table: TransferTable, transfer_id: str) -> Transfer:
    return table.add(Transfer(id=transfer_id, direction="out", peer="p:1", pairs=[("a", "b")], blocks=1, codec="raw"))


def _end(table: TransferTable, t: Transfer, state: State = State.DONE) -> None:
    """What the driver records as a transfer runs and ends (``Transfer.enter``), then retires it."""
    t.enter(Phase.CONNECTING)
    t.enter(Phase(state.value), "Cancelled" if state == State.CANCELLED else None, "why" if state != State.DONE else None)
    table.retire(t)


def _read(watcher) -> list[tuple[str, str, str | None]]:
    return [(e.kind, e.id, e.record["state"] if e.record else None) for e in watcher.drain()]


def test_a_watcher_gets_the_current_states_then_the_changes():
    table = TransferTable(max_active=8)
    hub = Hub(table)
    done, running = _transfer(table, "done"), _transfer(table, "running")
    _end(table, done)
    watcher = hub.subscribe(["done", "running", "gone"], "", follow=False)
    assert _read(watcher) == [("snapshot", "done", "done"), ("snapshot", "running", "queued"),
                              ("not_found", "gone", None)]
    assert not watcher.finished  # "running" has not ended
    _end(table, running, State.CANCELLED)
    assert _read(watcher) == [("changed", "running", "cancelled")] and watcher.finished


def test_watching_everything_and_by_submitter():
    table = TransferTable(max_active=8)
    hub = Hub(table)
    everything = hub.subscribe([], "", follow=True)
    mine = hub.subscribe([], "me", follow=False)
    assert mine.finished  # nothing of mine in progress
    t = _transfer(table, "t")
    hub.tag(t, "me")
    other = _transfer(table, "other")
    hub.tag(other, "someone else")
    _end(table, t)
    assert _read(everything) == [("changed", "other", "queued"), ("changed", "t", "done")]
    assert _read(mine) == [("changed", "t", "done")] and mine.finished
    late = hub.subscribe([], "me", follow=False, since=t.created)  # a resubscription catches up
    assert _read(late) == [("snapshot", "t", "done")]


def test_unread_states_coalesce_and_a_watcher_far_behind_overflows():
    table = TransferTable(max_active=MAX_BEHIND + 8)
    hub = Hub(table)
    slow = hub.subscribe([], "", follow=True)
    t = _transfer(table, "t")
    _end(table, t)
    assert _read(slow) == [("changed", "t", "done")]  # queued, then done: only the latest unread
    for i in range(MAX_BEHIND):
        _transfer(table, f"n{i}")
    assert not slow.overflowed and len(slow.unread) == MAX_BEHIND
    _transfer(table, "one-more")
    assert slow.overflowed  # its stream ends with RESOURCE_EXHAUSTED; the client resubscribes
    with pytest.raises(BadRequest):
        hub.subscribe([f"id{i}" for i in range(MAX_IDS + 1)], "", follow=False)


def test_closing_ends_every_stream_and_stops_listening():
    table = TransferTable(max_active=8)
    hub = Hub(table)
    watcher = hub.subscribe([], "", follow=True)
    hub.close()
    assert watcher.closed and watcher.wake.is_set() and not table.listeners


def test_streams_that_watch_one_transfer_themselves_count_against_the_bound():
    from kvferry.api.grpc.watch import MAX_WATCHERS
    from kvferry.engine.errors import Overloaded

    hub = Hub(TransferTable(max_active=8))
    with contextlib.ExitStack() as streams:
        for _ in range(MAX_WATCHERS - 1):
            streams.enter_context(hub.held())
        last = hub.subscribe([], "", follow=True)
        with pytest.raises(Overloaded):
            hub.subscribe([], "", follow=True)
        with pytest.raises(Overloaded):
            with hub.held():
                pass
        hub.unsubscribe(last)
    with hub.held():  # all closed: room again
        hub.subscribe([], "", follow=True)
