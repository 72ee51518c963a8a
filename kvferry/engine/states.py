"""Where a transfer's states live: both sides' phases, the events that move them, and what each
move asks the engine to do. Sans-IO: ``step(side, phase, event) -> (phase, actions)`` is a table
lookup with no sockets, tasks or clocks, so every path is testable on its own
(``tests/engine/test_states.py``); ``driver.py`` executes the actions.

Flow control has one notion here, the *credit*: how many chunks the sender may put on the wire
before the receiver has posted buffers for more. Every way into sending is a credit grant
(``GRANTS``): chunks riding inline behind the announce and the first eager chunks are the initial
credit the receiver is known to honour (it posts their buffers before it reads another message);
each CTS the receiver sends unasked is one more (``CREDIT``); memory lent by the receiver (an
ACCEPT's targets, a standing lease) is a credit for the whole transfer. No byte arrives without a
posted buffer.

A terminal phase absorbs every event. An event a phase does not expect is never ignored: one the
peer caused ends the transfer as a protocol violation; one the engine caused is a bug
(``IllegalMove``). Whatever ends a transfer, the move to a terminal phase carries exactly one
``Release`` and one ``Finish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import EngineError


class State(str, Enum):
    """A transfer's public state, as the REST API and the SDK report it."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (State.DONE, State.FAILED, State.CANCELLED)


class Side(str, Enum):
    """The values are ``Transfer.direction``'s."""

    SEND = "out"
    RECEIVE = "in"


class Phase(str, Enum):
    QUEUED = "queued"          # both: recorded; nothing sent (sender) or admitted yet (receiver)
    CONNECTING = "connecting"  # sender: reaching the peer, choosing the codec
    OFFERED = "offered"        # sender: announced with a same-host offer; waits for the ACCEPT
    STREAMING = "streaming"    # sender: chunks go out as credit allows
    WRITING = "writing"        # sender: writing the receiver's lent memory itself
    CONFIRMING = "confirming"  # sender: every byte is out; waits for the receiver's DONE
    RECEIVING = "receiving"    # receiver: chunks land in posted buffers and are decoded in order
    LENT = "lent"              # receiver: the sender writes its lent memory; waits for WRITTEN
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED, Phase.CANCELLED)

    @property
    def public(self) -> State:
        if self == Phase.QUEUED:
            return State.QUEUED
        return State(self.value) if self.terminal else State.RUNNING


PHASES: dict[Side, tuple[Phase, ...]] = {
    Side.SEND: (Phase.QUEUED, Phase.CONNECTING, Phase.OFFERED, Phase.STREAMING, Phase.WRITING, Phase.CONFIRMING),
    Side.RECEIVE: (Phase.QUEUED, Phase.RECEIVING, Phase.LENT),
}
TERMINAL = (Phase.DONE, Phase.FAILED, Phase.CANCELLED)


class On(str, Enum):
    """What happened. The peer's doing (``PEER``) or this sidecar's."""

    # sender
    DIAL = "dial"                        # the send starts: reach the peer, choose the codec
    LEASE = "lease"                      # a standing lease covers every destination: write at once
    ANNOUNCE = "announce"                # announced, some chunks still to stream
    ANNOUNCE_ALL = "announce all"        # announced with every chunk inline behind it
    OFFER = "offer"                      # announced with a same-host offer (nothing inline)
    ACCEPT = "accept"                    # the receiver's ACCEPT, lending nothing
    ACCEPT_LENT = "accept lent"          # the receiver's ACCEPT, lending its destination memory
    CREDIT = "credit"                    # the receiver granted a chunk a buffer (its CTS, sent unasked)
    SENT_LAST = "sent last"              # the last chunk left
    WRITTEN = "written"                  # the lent memory is written, and the receiver told so
    REDIAL = "redial"                    # the pooled connection was dead before the peer said anything: start again
    PEER_DONE = "peer done"              # the receiver's DONE: every block written
    # receiver
    ADMIT = "admit"                      # the announce is valid: receives posted for the first chunks
    ADMIT_LENT = "admit lent"            # the announce is valid and memory lent: the sender writes it
    CHUNK = "chunk"                      # a chunk is decoded into its blocks
    LAST_CHUNK = "last chunk"            # the last chunk is decoded: every block written
    PEER_WRITTEN = "peer written"        # the sender's WRITTEN (or an announce flagged WRITTEN)
    # either side, from any live phase
    CANCEL = "cancel"                    # a request or the shutdown
    PEER_CANCEL = "peer cancel"          # the peer's CANCEL
    FAIL = "fail"                        # an error here: codec, memory, a wait that timed out
    PEER_FAIL = "peer fail"              # the peer's REJECT or ERROR
    DEADLINE = "deadline"                # no answer within transfer_timeout (transfers without a task)
    LOST = "lost"                        # the connection is gone
    VIOLATION = "violation"              # a message that breaks the peer protocol


PEER = frozenset({On.ACCEPT, On.ACCEPT_LENT, On.CREDIT, On.PEER_DONE, On.CHUNK, On.PEER_WRITTEN, On.PEER_CANCEL,
                  On.PEER_FAIL, On.LOST, On.VIOLATION})
ENDINGS = {On.CANCEL: Phase.CANCELLED, On.PEER_CANCEL: Phase.CANCELLED, On.FAIL: Phase.FAILED,
           On.PEER_FAIL: Phase.FAILED, On.DEADLINE: Phase.FAILED, On.LOST: Phase.FAILED, On.VIOLATION: Phase.FAILED}

# The credit each event grants the sender: the one flow-control notion. "initial": the inline
# chunks and the first eager ones, whose receives are posted before the next message is read;
# "one": a buffer posted; "whole": the transfer, written into lent memory or riding inline.
GRANTS = {On.ANNOUNCE: "initial", On.ANNOUNCE_ALL: "whole", On.ACCEPT: "initial", On.CREDIT: "one",
          On.ACCEPT_LENT: "whole", On.LEASE: "whole", On.ADMIT: "initial", On.ADMIT_LENT: "whole"}

S, R, P = Side.SEND, Side.RECEIVE, Phase
MOVES: dict[tuple[Side, Phase, On], Phase] = {
    (S, P.QUEUED, On.DIAL): P.CONNECTING,
    (S, P.CONNECTING, On.LEASE): P.WRITING,
    (S, P.CONNECTING, On.ANNOUNCE): P.STREAMING,
    (S, P.CONNECTING, On.ANNOUNCE_ALL): P.CONFIRMING,
    (S, P.CONNECTING, On.OFFER): P.OFFERED,
    (S, P.OFFERED, On.ACCEPT): P.STREAMING,
    (S, P.OFFERED, On.ACCEPT_LENT): P.WRITING,
    (S, P.STREAMING, On.CREDIT): P.STREAMING,
    (S, P.STREAMING, On.SENT_LAST): P.CONFIRMING,
    (S, P.WRITING, On.WRITTEN): P.CONFIRMING,
    (S, P.QUEUED, On.WRITTEN): P.CONFIRMING,  # written under a standing lease and announced before any move
    (S, P.CONFIRMING, On.PEER_DONE): P.DONE,
    **{(S, phase, On.REDIAL): P.QUEUED for phase in PHASES[S] if phase != P.QUEUED},
    (R, P.QUEUED, On.ADMIT): P.RECEIVING,
    (R, P.QUEUED, On.ADMIT_LENT): P.LENT,
    (R, P.QUEUED, On.PEER_WRITTEN): P.DONE,  # an announce flagged WRITTEN: every block is in place already
    (R, P.RECEIVING, On.CHUNK): P.RECEIVING,
    (R, P.RECEIVING, On.LAST_CHUNK): P.DONE,
    (R, P.LENT, On.PEER_WRITTEN): P.DONE,
    # A receiver is refused nothing by its sender: the sender CANCELs.
    **{(side, phase, on): end for side in Side for phase in PHASES[side] for on, end in ENDINGS.items()
       if not (side == R and on == On.PEER_FAIL)},
}
del S, R, P


class IllegalMove(EngineError):
    """The engine applied an event its transfer's phase does not expect: a bug, not bad input."""


@dataclass(frozen=True)
class Event:
    on: On
    kind: str | None = None  # the error class an ending reports (``FAIL``, ``PEER_FAIL``, ...)
    reason: str | None = None


@dataclass(frozen=True)
class Release:
    """Let go of what the transfer holds: posted receives, chunk tags, a deadline, busy regions."""


@dataclass(frozen=True)
class Tell:
    """Tell the peer: ``message`` is ``done``, ``cancel`` or ``error``."""

    message: str
    kind: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Finish:
    """The transfer ended in ``outcome``: retire it, count it, drop its link, stop its task."""

    outcome: Phase
    kind: str | None = None
    reason: str | None = None


Action = Release | Tell | Finish


def step(side: Side, phase: Phase, event: Event) -> tuple[Phase, tuple[Action, ...]]:
    """The phase after ``event`` and what to do about it.

    Raises:
        IllegalMove: an event of this sidecar's own that ``phase`` does not expect.
    """
    if phase.terminal:
        return phase, ()
    after = MOVES.get((side, phase, event.on))
    if after is None:
        if event.on not in PEER or phase not in PHASES[side]:
            raise IllegalMove(f"{side.name.lower()} {phase.value}: {event.on.value} is not expected")
        event = Event(On.VIOLATION, "ProtocolViolation", f"{event.on.value} while {phase.value}")
        after = MOVES[(side, phase, On.VIOLATION)]
    if not after.terminal:
        return after, ()
    # The peer hears first: it waits on that word, and releasing and finishing are this side's own.
    return after, (*_tell(side, event), Release(), Finish(after, event.kind, event.reason))


def _tell(side: Side, event: Event) -> tuple[Tell, ...]:
    """What the peer hears of an ending: nothing where it ended the transfer itself or cannot be
    reached; a receiver's failure is an ERROR (the sender fails too), a sender's a CANCEL."""
    if event.on in (On.PEER_CANCEL, On.PEER_FAIL, On.LOST, On.PEER_DONE):
        return ()
    if event.on in (On.LAST_CHUNK, On.PEER_WRITTEN):
        return (Tell("done"),)
    if event.on == On.CANCEL:
        return (Tell("cancel", event.kind, event.reason),)
    if side == Side.RECEIVE:
        return (Tell("error", event.kind, event.reason),)
    return (Tell("cancel", event.kind, f"{event.kind}: {event.reason}"),)


def table() -> str:
    """The moves as a Markdown table (``docs/protocol.md`` holds a copy, checked by a test)."""
    rows = ["| side | from | event | to | credit |", "|---|---|---|---|---|"]
    for (side, phase, on), after in MOVES.items():
        if on not in ENDINGS and not (on == On.REDIAL and phase != Phase.CONNECTING):
            source = "any but queued" if on == On.REDIAL else phase.value
            rows.append(f"| {side.name.lower()} | {source} | {on.value} | {after.value} | {GRANTS.get(on, '')} |")
    for on, end in ENDINGS.items():
        side = "send" if on == On.PEER_FAIL else "both"
        rows.append(f"| {side} | any live | {on.value} | {end.value} | |")
    return "\n".join(rows) + "\n"
