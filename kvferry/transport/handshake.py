"""The connection handshake: both ends prove they hold the shared peer secret (HMAC-SHA256
challenge-response over fresh nonces, byte layout in ``wire.py``) before any other message is
read. The secret itself never crosses the wire, and a recorded handshake cannot be replayed:
each side's MAC covers the other side's fresh nonce."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from . import wire
from .errors import AuthenticationFailed, ProtocolError, TransportError, TransportTimeout
from .link import Link
from .wire import Message, MessageType

_ACCEPTOR = b"kvferry/2 acceptor"
_CONNECTOR = b"kvferry/2 connector"


def mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


async def _recv(link: Link, expected: MessageType, length: int) -> bytes:
    message = wire.unpack(await link.recv_header(wire.HEADER_SIZE))
    if message.type == MessageType.REJECT:
        reason = bytearray(message.length)
        await link.recv_payload(memoryview(reason))
        raise AuthenticationFailed(f"peer refused the handshake: {reason.decode(errors='replace')}")
    if message.type != expected or message.length != length:
        raise ProtocolError(f"handshake expected {expected.name} of {length} bytes, got {message.type.name} "
                            f"of {message.length}")
    payload = bytearray(length)
    if length:
        await link.recv_payload(memoryview(payload))
    return bytes(payload)


async def connector(link: Link, secret: bytes, timeout: float) -> None:
    """Run the connecting side's handshake.

    Raises:
        AuthenticationFailed: the acceptor does not hold our secret, or refused ours.
        TransportTimeout, ProtocolError, PeerLost: as the link fails.
    """
    async def run() -> None:
        nonce_c = secrets.token_bytes(wire.NONCE_BYTES)
        await link.send(Message(MessageType.HELLO, length=len(nonce_c)).pack(), memoryview(nonce_c))
        reply = await _recv(link, MessageType.HELLO, wire.NONCE_BYTES + wire.MAC_BYTES)
        nonce_s, proof = reply[:wire.NONCE_BYTES], reply[wire.NONCE_BYTES:]
        if not hmac.compare_digest(proof, mac(secret, _ACCEPTOR, nonce_c, nonce_s)):
            raise AuthenticationFailed(f"{link.peer} does not hold the peer secret")
        answer = mac(secret, _CONNECTOR, nonce_s, nonce_c)
        await link.send(Message(MessageType.AUTH, length=len(answer)).pack(), memoryview(answer))
        await _recv(link, MessageType.AUTH, 0)

    await _bounded(run(), link, timeout)


async def acceptor(link: Link, secret: bytes, timeout: float) -> None:
    """Run the accepting side's handshake; on failure the connector is told why.

    Raises:
        AuthenticationFailed, TransportTimeout, ProtocolError, PeerLost.
    """
    async def run() -> None:
        nonce_c = await _recv(link, MessageType.HELLO, wire.NONCE_BYTES)
        nonce_s = secrets.token_bytes(wire.NONCE_BYTES)
        reply = nonce_s + mac(secret, _ACCEPTOR, nonce_c, nonce_s)
        await link.send(Message(MessageType.HELLO, length=len(reply)).pack(), memoryview(reply))
        answer = await _recv(link, MessageType.AUTH, wire.MAC_BYTES)
        if not hmac.compare_digest(answer, mac(secret, _CONNECTOR, nonce_s, nonce_c)):
            reason = b"authentication failed"
            await link.send(Message(MessageType.REJECT, length=len(reason)).pack(), memoryview(reason))
            raise AuthenticationFailed(f"{link.peer} does not hold the peer secret")
        await link.send(Message(MessageType.AUTH).pack())

    await _bounded(run(), link, timeout)


async def _bounded(coro, link: Link, timeout: float) -> None:
    try:
        await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        await link.close()
        raise TransportTimeout(f"handshake with {link.peer} not done within {timeout:g} s") from None
    except TransportError:
        await link.close()
        raise
