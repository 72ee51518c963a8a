"""The connection handshake (byte layout in ``wire.py``): both ends prove they hold the shared
peer secret (HMAC-SHA256 over fresh nonces and everything said so far), agree on what they
speak (transport version, the layer above's protocol, the security mode), and derive the
session keys that seal every later message (``seal.py``). The secret never crosses the wire; a
recorded handshake cannot be replayed (each side's MAC covers the other's fresh nonce); a
mismatch of versions or modes fails at once with ``IncompatiblePeer`` naming both sides.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from . import wire
from .errors import AuthenticationFailed, IncompatiblePeer, ProtocolError, TransportError, TransportTimeout
from .link import Link
from .seal import Direction, derive
from .wire import Message, MessageType

_ACCEPTOR = b"kvferry/3 acceptor"
_CONNECTOR = b"kvferry/3 connector"
MODES = ("authenticated", "encrypted")


@dataclass(frozen=True)
class Offer:
    """What one end speaks: the layer above's protocol name and the security mode."""

    protocol: str = ""
    encrypt: bool = False

    def pack(self) -> bytes:
        name = self.protocol.encode()
        if len(name) > 255:
            raise ValueError("a protocol name is at most 255 bytes")
        return struct.pack("<BB", int(self.encrypt), len(name)) + name

    @classmethod
    def unpack(cls, data: bytes) -> Offer:
        if len(data) < 2 or data[0] > 1 or len(data) != 2 + data[1]:
            raise ProtocolError("malformed handshake offer")
        try:
            return cls(data[2:].decode(), bool(data[0]))
        except UnicodeDecodeError:
            raise ProtocolError("malformed handshake offer") from None

    def describe(self) -> str:
        return f"transport {wire.VERSION}, {self.protocol or 'no protocol'}, {MODES[self.encrypt]}"


@dataclass(frozen=True)
class Session:
    """The keys of an authenticated connection: what it sends and what it receives."""

    send: Direction
    receive: Direction


def mac(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, role + hashlib.sha256(transcript).digest(), hashlib.sha256).digest()


async def _recv(link: Link, expected: MessageType, min_length: int, max_length: int) -> bytes:
    try:
        message = wire.unpack(await link.recv_header(wire.HEADER_SIZE))
    except wire.VersionMismatch as exc:
        reason = f"incompatible: {exc}".encode()
        # Said in the peer's own layout (the header's fields have not changed), so it can read why.
        await link.send(Message(MessageType.REJECT, tag=wire.REJECT_INCOMPATIBLE, length=len(reason)).pack(exc.version),
                        memoryview(reason))
        raise IncompatiblePeer(str(exc)) from None
    if message.type == MessageType.REJECT:
        reason = bytearray(message.length)
        await link.recv_payload(memoryview(reason))
        text = reason.decode(errors="replace")
        if message.tag == wire.REJECT_INCOMPATIBLE:
            raise IncompatiblePeer(f"{link.peer} refused the connection: {text}")
        raise AuthenticationFailed(f"peer refused the handshake: {text}")
    if message.type != expected or not min_length <= message.length <= max_length:
        raise ProtocolError(f"handshake expected {expected.name} of {min_length}..{max_length} bytes, got "
                            f"{message.type.name} of {message.length}")
    payload = bytearray(message.length)
    if message.length:
        await link.recv_payload(memoryview(payload))
    return bytes(payload)


async def _refuse(link: Link, reason: str, tag: int = 0) -> None:
    text = reason.encode()[:wire.MAX_REASON_BYTES]
    await link.send(Message(MessageType.REJECT, tag=tag, length=len(text)).pack(), memoryview(text))


async def connector(link: Link, secret: bytes, timeout: float, offer: Offer = Offer()) -> Session:
    """Run the connecting side's handshake; returns the connection's session keys.

    Raises:
        AuthenticationFailed: the acceptor does not hold our secret, or refused ours.
        IncompatiblePeer: the two ends speak different versions or security modes.
        TransportTimeout, ProtocolError, PeerLost: as the link fails.
    """
    async def run() -> Session:
        nonce_c = secrets.token_bytes(wire.NONCE_BYTES)
        hello = nonce_c + offer.pack()
        await link.send(Message(MessageType.HELLO, length=len(hello)).pack(), memoryview(hello))
        reply = await _recv(link, MessageType.HELLO, wire.NONCE_BYTES + 2 + wire.MAC_BYTES,
                            wire.NONCE_BYTES + wire.MAX_OFFER_BYTES + wire.MAC_BYTES)
        nonce_s, theirs, proof = reply[:wire.NONCE_BYTES], reply[wire.NONCE_BYTES:-wire.MAC_BYTES], reply[-wire.MAC_BYTES:]
        transcript = hello + reply[:-wire.MAC_BYTES]
        if not hmac.compare_digest(proof, mac(secret, _ACCEPTOR, transcript)):
            raise AuthenticationFailed(f"{link.peer} does not hold the peer secret")
        answer = mac(secret, _CONNECTOR, transcript)
        await link.send(Message(MessageType.AUTH, length=len(answer)).pack(), memoryview(answer))
        await _recv(link, MessageType.AUTH, 0, 0)
        if Offer.unpack(theirs) != offer:  # the acceptor refuses first; this is only a guard
            raise IncompatiblePeer(f"{link.peer} speaks {Offer.unpack(theirs).describe()}; this side "
                                   f"{offer.describe()}")
        to_acceptor, to_connector = derive(secret, nonce_c, nonce_s, transcript)
        return Session(Direction(to_acceptor, offer.encrypt), Direction(to_connector, offer.encrypt))

    return await _bounded(run(), link, timeout)


async def acceptor(link: Link, secret: bytes, timeout: float, offer: Offer = Offer()) -> Session:
    """Run the accepting side's handshake; on failure the connector is told why.

    Raises:
        AuthenticationFailed, IncompatiblePeer, TransportTimeout, ProtocolError, PeerLost.
    """
    async def run() -> Session:
        hello = await _recv(link, MessageType.HELLO, wire.NONCE_BYTES + 2, wire.NONCE_BYTES + wire.MAX_OFFER_BYTES)
        nonce_c = hello[:wire.NONCE_BYTES]
        theirs = Offer.unpack(hello[wire.NONCE_BYTES:])
        if theirs != offer:
            reason = f"incompatible: the peer speaks {theirs.describe()}; this side {offer.describe()}"
            await _refuse(link, reason, wire.REJECT_INCOMPATIBLE)
            raise IncompatiblePeer(f"{link.peer} speaks {theirs.describe()}; this side {offer.describe()}")
        nonce_s = secrets.token_bytes(wire.NONCE_BYTES)
        said = nonce_s + offer.pack()
        transcript = hello + said
        reply = said + mac(secret, _ACCEPTOR, transcript)
        await link.send(Message(MessageType.HELLO, length=len(reply)).pack(), memoryview(reply))
        answer = await _recv(link, MessageType.AUTH, wire.MAC_BYTES, wire.MAC_BYTES)
        if not hmac.compare_digest(answer, mac(secret, _CONNECTOR, transcript)):
            await _refuse(link, "authentication failed")
            raise AuthenticationFailed(f"{link.peer} does not hold the peer secret")
        await link.send(Message(MessageType.AUTH).pack())
        to_acceptor, to_connector = derive(secret, nonce_c, nonce_s, transcript)
        return Session(Direction(to_connector, offer.encrypt), Direction(to_acceptor, offer.encrypt))

    return await _bounded(run(), link, timeout)


async def _bounded(coro, link: Link, timeout: float) -> Session:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        await link.close()
        raise TransportTimeout(f"handshake with {link.peer} not done within {timeout:g} s") from None
    except TransportError:
        await link.close()
        raise
