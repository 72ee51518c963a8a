"""Every connection starts with the HMAC handshake: a peer without the secret is refused before a
byte of its data is read, and MSG payloads reach the layer above in order."""

from __future__ import annotations

import asyncio

import pytest

from kvferry import transport
from tests.transport.conftest import config, run


def test_wrong_secret_is_refused_and_nothing_is_written(backend):
    async def main():
        listener = await transport.listen("127.0.0.1", 0, config(backend, secret=b"right"))
        buffer = bytearray(64)
        receive = listener.expect(5, buffer)
        try:
            with pytest.raises(transport.AuthenticationFailed):
                await transport.connect("127.0.0.1", listener.port, config(backend, secret=b"wrong"))
            assert receive.received == 0 and buffer == bytearray(64)
            good = await transport.connect("127.0.0.1", listener.port, config(backend, secret=b"right"))
            await good.send(5, b"x" * 64)
            assert await receive.wait(5) == 64 and buffer == bytearray(b"x" * 64)
            await good.close()
        finally:
            await listener.close()

    run(main())


def test_messages_arrive_in_order_both_ways(backend):
    async def main():
        got_server: list[bytes] = []
        got_client: list[bytes] = []

        def server_side(connection, payload):
            got_server.append(payload)
            connection.post_message(b"echo:" + payload)

        cfg = config(backend, secret=b"s3cret")
        listener = await transport.listen("127.0.0.1", 0, cfg, on_message=server_side)
        client = await transport.connect("127.0.0.1", listener.port, cfg,
                                         on_message=lambda c, p: got_client.append(p))
        try:
            for i in range(20):
                await client.send_message(f"m{i}".encode())
            for _ in range(200):
                if len(got_client) == 20:
                    break
                await asyncio.sleep(0.01)
            assert got_server == [f"m{i}".encode() for i in range(20)]
            assert got_client == [f"echo:m{i}".encode() for i in range(20)]
        finally:
            await client.close()
            await listener.close()

    run(main())


def test_silent_connector_is_dropped_after_the_handshake_timeout():
    async def main():
        listener = await transport.listen("127.0.0.1", 0, config("tcp", connect_timeout=0.5))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            # Say nothing: the acceptor must give up and close within its timeout.
            assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
            writer.close()
        finally:
            await listener.close()

    run(main())


def test_receive_timeout_raises_instead_of_spinning():
    async def main():
        listener = await transport.listen("127.0.0.1", 0, config("tcp"))
        try:
            receive = listener.expect(9, bytearray(8))
            with pytest.raises(transport.TransportTimeout):
                await asyncio.wait_for(receive.wait(0.2), 5)
        finally:
            await listener.close()

    run(main())


def test_credits_granted_beforehand_unasked_and_none(backend):
    """A receiver grants buffers on the connection a message came on: one the sender knows of
    (an initial credit: DATA at once), one it tells of by CTS unasked. DATA with no buffer is
    refused and its bytes dropped; a CTS nobody expects is dropped; the connection carries on."""
    async def main():
        cfg = config(backend)
        granted = {}

        def on_message(connection, payload):  # the layer above: "tags 1 and 2 are coming"
            granted[1] = connection.grant(1, bytearray(3 << 20), tell=False)
            granted[2] = connection.grant(2, bytearray(16))
            connection.grant(9, bytearray(8))  # a CTS for a tag the sender does not expect

        listener = await transport.listen("127.0.0.1", 0, cfg, on_message=on_message)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        try:
            client.expect_credits([2])
            with pytest.raises(ValueError, match="no credit"):
                await client.send(5, b"x", clearance=transport.Clearance.CREDIT)
            await client.send_message(b"go")
            await client.send(1, b"\x07" * (3 << 20), clearance=transport.Clearance.INITIAL)  # DATA messages, no CTS
            assert await granted[1].wait(5) == 3 << 20 and granted[1].buffer.obj == bytearray(b"\x07" * (3 << 20))
            await client.send(2, b"z" * 16, clearance=transport.Clearance.CREDIT)  # waits for the CTS sent unasked
            assert await granted[2].wait(5) == 16
            with pytest.raises(transport.TransferRejected, match="no receive posted"):
                await client.send(3, b"\x01" * (2 << 20), clearance=transport.Clearance.INITIAL)  # none granted
            late = bytearray(16)
            again = listener.expect(4, late)
            await client.send(4, b"q" * 16)  # the connection carries on, by rendezvous too
            assert await again.wait(5) == 16 and late == bytearray(b"q" * 16)
        finally:
            await client.close()
            await listener.close()

    run(main())
