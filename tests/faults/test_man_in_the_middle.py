"""A man in the middle without the peer secret: it relays the handshake as it is, then edits,
replays, drops or forges messages (it can recompute anything unkeyed, such as a header's CRC).
Every attempt fails the transfer or the connection; nothing it touched is ever handed on."""

from __future__ import annotations

import asyncio
import os

import google_crc32c
import pytest

from kvferry import transport
from kvferry.transport import wire
from kvferry.transport.wire import MessageType
from tests.transport.conftest import config, run

SECRET = b"s" * 32


async def _read_message(reader: asyncio.StreamReader, sealed: bool) -> tuple[bytes, bytes]:
    """(header + trailer, payload) of the next message on a v3 stream."""
    head = await reader.readexactly(wire.SEALED_HEADER_SIZE if sealed else wire.HEADER_SIZE)
    message = wire.unpack(head[:wire.HEADER_SIZE])
    payload = await reader.readexactly(message.length) if wire.has_payload(message) else b""
    return head, payload


class Middle:
    """Relays a connection message by message; ``tamper(direction, index, head, payload)``
    returns the list of (head, payload) to forward instead (after the 4 handshake messages)."""

    def __init__(self, upstream_port: int, tamper):
        self.upstream_port, self.tamper = upstream_port, tamper
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, c_reader, c_writer) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        handshaken = asyncio.Event()

        async def pump(reader, writer, direction):
            index = 0
            try:
                for _ in range(2):  # HELLO and AUTH each way, relayed as they are
                    head, payload = await _read_message(reader, False)
                    writer.write(head + payload)
                    await writer.drain()
                if direction == "s2c":
                    handshaken.set()
                await handshaken.wait()
                while True:
                    head, payload = await _read_message(reader, True)
                    for h, p in self.tamper(direction, index, head, payload):
                        writer.write(h + p)
                    index += 1
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(c_reader, s_writer, "c2s"), pump(s_reader, c_writer, "s2c"))

    async def close(self) -> None:
        self.server.close()


def _recrc(head: bytes) -> bytes:
    body = head[:44]
    return body + google_crc32c.value(body).to_bytes(4, "little") + head[wire.HEADER_SIZE:]


async def _attempt(tamper, size: int = 3 << 20) -> tuple[BaseException | None, BaseException | None, bytes, bytes]:
    cfg = config("tcp", secret=SECRET, op_timeout=3.0)
    listener = await transport.listen("127.0.0.1", 0, cfg)
    middle = Middle(listener.port, tamper)
    port = await middle.start()
    payload = os.urandom(size)
    buffer = bytearray(size)
    receive = listener.expect(42, buffer)
    connection = await transport.connect("127.0.0.1", port, cfg)
    sent = received = None
    try:
        await connection.send(42, payload)
    except transport.TransportError as exc:
        sent = exc
    try:
        await receive.wait(3.0)
    except transport.TransportError as exc:
        received = exc
    await connection.close()
    await listener.close()
    await middle.close()
    return sent, received, payload, bytes(buffer)


def _data(head: bytes) -> bool:
    return wire.unpack(head[:wire.HEADER_SIZE]).type == MessageType.DATA


def test_an_untouched_relay_delivers():
    sent, received, payload, buffer = run(_attempt(lambda d, i, h, p: [(h, p)]), timeout=60)
    assert sent is None and received is None and buffer == payload


def test_an_edited_payload_with_its_crc_recomputed_is_refused():
    def tamper(direction, index, head, payload):
        if direction == "c2s" and _data(head) and payload:
            edited = bytearray(payload)
            edited[1000] ^= 0xFF
            return [(_recrc(head), bytes(edited))]
        return [(head, payload)]

    sent, received, payload, buffer = run(_attempt(tamper), timeout=60)
    assert isinstance(received, transport.CorruptPayload), received
    assert sent is not None


def test_a_zeroed_payload_tag_is_refused():
    def tamper(direction, index, head, payload):
        if direction == "c2s" and _data(head):
            return [(head[:wire.HEADER_SIZE] + bytes(16) + head[wire.HEADER_SIZE + 16:], payload)]
        return [(head, payload)]

    sent, received, _, _ = run(_attempt(tamper), timeout=60)
    assert received is not None and sent is not None


@pytest.mark.parametrize("attack", ["replay", "drop", "forge"])
def test_replayed_dropped_or_forged_messages_close_the_connection(attack):
    seen: list[tuple[bytes, bytes]] = []

    def tamper(direction, index, head, payload):
        if direction != "c2s":
            return [(head, payload)]
        seen.append((head, payload))
        if index == 1:
            if attack == "replay":
                return [seen[0], (head, payload)]
            if attack == "drop":
                return []
            forged = wire.Message(MessageType.DATA, 42, 0, 4, 3 << 20).pack()
            return [(forged + os.urandom(32), b"evil"), (head, payload)]
        return [(head, payload)]

    sent, received, payload, buffer = run(_attempt(tamper), timeout=60)
    assert received is not None and sent is not None
    assert buffer != payload
