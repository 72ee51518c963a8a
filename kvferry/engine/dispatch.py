"""The peer protocol's dispatch: each peer message a connection's reader hands over is acted on
here, at once (the reader never awaits): an ANNOUNCE goes to admission, lease messages to the
leases, and the rest to the transfer they name, taken only from the connection it runs on. A
message a receiver never expects (ACCEPT, DONE, REJECT, ERROR) is an event of its state machine
too, which ends the transfer as a protocol violation."""

from __future__ import annotations

from kvferry import transport

from . import peer
from .context import TransferContext
from .driver import settle
from .errors import Overloaded, PeerError, ProtocolViolation
from .incoming import Admission
from .leases import Held
from .states import Event, On
from .transfers import Transfer


# Messages only a sender takes, as the events they are to a receiver's state machine.
_SENDERS_ONLY = {peer.Accept: On.ACCEPT, peer.Done: On.PEER_DONE, peer.Reject: On.PEER_FAIL, peer.Error: On.PEER_FAIL}


def on_message(ctx: TransferContext, admission: Admission, connection: transport.Connection, payload: bytes) -> None:
    """A peer message (called from the connection's reader, so never awaits)."""
    ctx.spinner.touch()
    try:
        message = peer.unpack(payload)
    except ProtocolViolation as exc:
        ctx.log_peer_failure(f"dropped a malformed peer message from {connection.peer}: {exc}")
        ctx.metrics.errors.labels("ProtocolViolation").inc()
        return
    body = message.body
    if isinstance(body, peer.Announce):
        admission.accept(connection, message.transfer_id, body)
        return
    if isinstance(body, peer.Revoke):
        ctx.leases.on_revoke(connection, body.region)
        return
    if isinstance(body, peer.Revoked):
        if not ctx.leases.on_revoked(connection, body.region):
            _abort_protocol(ctx, None, connection, f"REVOKED of region {body.region!r}, which was not revoked")
        return
    link = ctx.links.get(message.transfer_id)
    if link is None or link.connection is not connection:
        return  # finished already, or not this peer's to speak for: nothing to do
    t = ctx.transfers.find(message.transfer_id)
    if t is not None and t.direction == "in" and type(body) in _SENDERS_ONLY:
        _protocol(ctx, connection, f"{type(body).__name__.upper()} for a transfer it sends")
        ctx.driver.apply(t, Event(_SENDERS_ONLY[type(body)]))
        return
    if isinstance(body, peer.Chunk):
        if link.incoming is None or not link.incoming.arrived(body):
            _abort_protocol(ctx, t, connection, f"unexpected inline chunk {body.index}")
    elif isinstance(body, peer.Cancel):
        if t is not None:
            ctx.driver.apply(t, Event(On.PEER_CANCEL, "Cancelled", f"cancelled by the peer: {body.reason}"))
    elif isinstance(body, peer.Accept):
        if t is not None:
            t.mark("accepted")
        if link.offer is not None and body.targets and len(body.targets) == len(link.offer[0]):
            ctx.leases.hold(connection, [Held(name, target, shape, link.offer[2]) for name, shape, target
                                       in zip(link.offer[0], link.offer[1], body.targets)])
        elif link.offer is not None:
            ctx.leases.decline(connection, link.offer[0])
        if not link.accepted.done():
            link.accepted.set_result(body)
    elif isinstance(body, peer.Written):
        if link.incoming is None or not link.incoming.written_by_peer(body):
            _abort_protocol(ctx, t, connection, "WRITTEN for a transfer that lent no memory")
    elif isinstance(body, peer.Done):
        settle(link, body)
    else:  # Reject or Error
        verb = "refused" if isinstance(body, peer.Reject) else "failed"
        # A receiver too busy to take it wrote nothing: said as such, so a client may send it again.
        kind = Overloaded if isinstance(body, peer.Reject) and body.error == "Overloaded" else PeerError
        settle(link, error=kind(f"the receiver {verb} the transfer: {body.error}: {body.reason}"))


def _protocol(ctx: TransferContext, connection: transport.Connection, reason: str) -> None:
    """Count and log (rate-limited) a peer's breach of the protocol."""
    ctx.metrics.errors.labels("ProtocolViolation").inc()
    ctx.log_peer_failure(f"peer {connection.peer} broke the protocol: {reason}")


def _abort_protocol(ctx: TransferContext, t: Transfer | None, connection: transport.Connection, reason: str) -> None:
    _protocol(ctx, connection, reason)
    if t is not None:
        ctx.driver.apply(t, Event(On.VIOLATION, "ProtocolViolation", reason))
