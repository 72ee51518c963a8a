"""A hand-driven data-plane peer for tests that must break the protocol on purpose: it
handshakes like a sidecar (holding the secret, so every message it sends is properly sealed),
then writes whatever messages a test composes, in any order."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from kvferry.engine import peer
from kvferry.transport import handshake, tcp, wire
from kvferry.transport.config import TransportConfig
from kvferry.transport.seal import TAG_BYTES
from kvferry.transport.wire import Message, MessageType

OFFER = handshake.Offer(f"kvferry-peer/{peer.VERSION}")
_NO_TAG = bytes(TAG_BYTES)


class RawPeer:
    def __init__(self, link: tcp.TcpLink, session: handshake.Session):
        self.link, self.session = link, session

    @classmethod
    async def connect(cls, address: str, secret: bytes, offer: handshake.Offer = OFFER,
                      source: str | None = None) -> RawPeer:
        """``source``: the local (IPv4) address to connect from, as another host would."""
        host, port = address.rsplit(":", 1)
        if source is None:
            link = await tcp.connect(host, int(port), TransportConfig(backend="tcp", secret=secret))
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((source, 0))
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            link = tcp.TcpLink(sock)
        return cls(link, await handshake.connector(link, secret, 5, offer))

    @classmethod
    async def accept(cls, link: tcp.TcpLink, secret: bytes, offer: handshake.Offer = OFFER) -> RawPeer:
        return cls(link, await handshake.acceptor(link, secret, 5, offer))

    def seal(self, message: Message, payload: Any = b"") -> bytes:
        """The sealed bytes of one message, taking the next sequence number."""
        out = self.session.send
        seq = out.next()
        tag = out.payload_tag(seq, payload) if len(payload) else _NO_TAG
        header = message.pack()
        return header + tag + out.header_tag(seq, header, tag) + bytes(payload)

    async def send(self, message: Message, payload: Any = b"") -> None:
        await self.link.send(self.seal(message, payload))

    async def send_peer(self, body: peer.Message) -> None:
        data = peer.pack(body)
        await self.send(Message(MessageType.MSG, length=len(data)), data)

    async def recv(self) -> tuple[Message, bytes]:
        """The next message and its payload (its seals are checked)."""
        sealed = await self.link.recv_header(wire.SEALED_HEADER_SIZE)
        header, tag = sealed[:wire.HEADER_SIZE], sealed[wire.HEADER_SIZE:wire.HEADER_SIZE + TAG_BYTES]
        message = wire.unpack(header)
        seq = self.session.receive.next()
        assert self.session.receive.check_header(seq, header, tag, sealed[wire.HEADER_SIZE + TAG_BYTES:])
        payload = bytearray(message.length if wire.has_payload(message) else 0)
        if payload:
            await self.link.recv_payload(memoryview(payload))
            assert self.session.receive.check_payload(seq, payload, tag)
        return message, bytes(payload)

    async def close(self) -> None:
        await self.link.close()
