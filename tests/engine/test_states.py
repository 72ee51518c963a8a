"""The transfer state machine as a table, without sockets: every (side, phase, event) has a
defined outcome, terminal phases absorb every event, every phase is reachable and can end, and
any sequence of events ends a transfer exactly once (one ``Release``, one ``Finish``)."""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine import states
from kvferry.engine.states import (ENDINGS, MOVES, PEER, PHASES, TERMINAL, Event, Finish, IllegalMove, On, Phase,
                                   Release, Side, State, Tell, step)

DOCS = Path(__file__).parents[2] / "docs" / "protocol.md"
ALL = [(side, phase, on) for side in Side for phase in (*PHASES[side], *TERMINAL) for on in On]


def _outcome(side: Side, phase: Phase, on: On) -> tuple[Phase, tuple] | type[IllegalMove]:
    try:
        return step(side, phase, Event(on, "Kind", "why"))
    except IllegalMove:
        return IllegalMove


@pytest.mark.parametrize("side,phase,on", ALL, ids=[f"{s.name}-{p.value}-{o.value}" for s, p, o in ALL])
def test_every_phase_and_event_has_a_defined_outcome(side, phase, on):
    outcome = _outcome(side, phase, on)
    if phase.terminal:
        assert outcome == (phase, ())  # absorbed
    elif (side, phase, on) in MOVES:
        after, actions = outcome
        assert after == MOVES[(side, phase, on)]
        assert bool(actions) == after.terminal
    elif on in PEER:  # the peer's doing, unexpected here: a protocol violation, never ignored
        after, actions = outcome
        assert after == Phase.FAILED
        assert actions[-1] == Finish(Phase.FAILED, "ProtocolViolation", f"{on.value} while {phase.value}")
    else:  # this sidecar's own doing, unexpected: a bug
        assert outcome is IllegalMove


def test_a_phase_of_the_other_side_is_a_bug_not_a_violation():
    with pytest.raises(IllegalMove):
        step(Side.RECEIVE, Phase.STREAMING, Event(On.PEER_DONE))


@pytest.mark.parametrize("side", list(Side))
def test_every_move_into_a_terminal_phase_releases_tells_and_finishes_once(side):
    for phase in PHASES[side]:
        for on in On:
            outcome = _outcome(side, phase, on)
            if outcome is IllegalMove or not outcome[0].terminal:
                continue
            after, actions = outcome
            assert isinstance(actions[-2], Release) and isinstance(actions[-1], Finish)
            assert actions[-1].outcome == after
            assert sum(isinstance(a, Release) for a in actions) == sum(isinstance(a, Finish) for a in actions) == 1
            # the peer hears first: it waits on that word
            assert all(isinstance(a, Tell) for a in actions[:-2]) and len(actions) <= 3


@pytest.mark.parametrize("side", list(Side))
def test_every_phase_is_reachable_and_every_path_can_end_done(side):
    reached, queue = {Phase.QUEUED}, deque([Phase.QUEUED])
    while queue:
        phase = queue.popleft()
        for (s, p, _), after in MOVES.items():
            if s == side and p == phase and after not in reached:
                reached.add(after)
                if not after.terminal:
                    queue.append(after)
    assert reached == {*PHASES[side], *TERMINAL}
    for phase in PHASES[side]:  # and from every live phase the transfer can still succeed
        seen, queue = {phase}, deque([phase])
        while queue:
            for (s, p, _), after in MOVES.items():
                if s == side and p == queue[0] and after not in seen:
                    seen.add(after)
                    queue.append(after)
            queue.popleft()
        assert Phase.DONE in seen, phase


def test_what_the_peer_hears():
    def tells(side, phase, on):
        return [a for a in step(side, phase, Event(on, "CorruptFrame", "chunk 3"))[1] if isinstance(a, Tell)]

    assert tells(Side.RECEIVE, Phase.RECEIVING, On.LAST_CHUNK) == [Tell("done")]
    assert tells(Side.RECEIVE, Phase.LENT, On.PEER_WRITTEN) == [Tell("done")]
    assert tells(Side.RECEIVE, Phase.RECEIVING, On.FAIL) == [Tell("error", "CorruptFrame", "chunk 3")]
    assert tells(Side.SEND, Phase.STREAMING, On.FAIL) == [Tell("cancel", "CorruptFrame", "CorruptFrame: chunk 3")]
    assert tells(Side.SEND, Phase.QUEUED, On.CANCEL) == [Tell("cancel", "CorruptFrame", "chunk 3")]
    for on in (On.PEER_CANCEL, On.PEER_FAIL, On.LOST):  # it ended the transfer, or cannot hear
        assert tells(Side.SEND, Phase.CONFIRMING, on) == []
    assert tells(Side.SEND, Phase.CONFIRMING, On.PEER_DONE) == []


def test_public_states():
    assert Phase.QUEUED.public == State.QUEUED
    assert {p.public for side in Side for p in PHASES[side] if p != Phase.QUEUED} == {State.RUNNING}
    assert [p.public for p in TERMINAL] == [State.DONE, State.FAILED, State.CANCELLED]


def test_every_ending_is_allowed_from_every_live_phase():
    for side in Side:
        for phase in PHASES[side]:
            for on, end in ENDINGS.items():
                after, actions = step(side, phase, Event(on, "Kind", "why"))
                assert after.terminal and actions[-1].outcome == after
                if not (side == Side.RECEIVE and on == On.PEER_FAIL):  # a sender refuses nothing: a violation
                    assert after == end


@settings(max_examples=400, deadline=None)
@given(side=st.sampled_from(list(Side)), events=st.lists(st.sampled_from(list(On)), max_size=30),
       closing=st.sampled_from(sorted(ENDINGS)))
def test_any_sequence_of_events_ends_the_transfer_exactly_once(side, events, closing):
    phase, actions = Phase.QUEUED, []
    for on in [*events, closing]:
        try:
            phase, done = step(side, phase, Event(on, "Kind", "why"))
        except IllegalMove:  # the engine never applies these (a bug); skipped here
            assert on not in PEER
            continue
        if actions and isinstance(actions[-1], Finish):
            assert done == ()  # nothing after the end
        actions.extend(done)
    assert phase.terminal
    assert sum(isinstance(a, Finish) for a in actions) == 1
    assert sum(isinstance(a, Release) for a in actions) == 1
    assert isinstance(actions[-1], Finish) and actions[-1].outcome == phase


def test_the_documented_table_is_the_modules():
    text = DOCS.read_text()
    match = re.search(r"<!-- states:begin -->\n(.*?)<!-- states:end -->", text, re.DOTALL)
    assert match, "docs/protocol.md lost its generated state table"
    regenerate = "python -c 'from kvferry.engine import states; print(states.table(), end=\"\")'"
    assert match[1] == states.table(), f"the table is stale: {regenerate}"
