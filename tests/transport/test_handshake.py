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


def test_eager_send_to_a_posted_receive_and_to_none(backend):
    async def main():
        cfg = config(backend)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        try:
            buffer = bytearray(3 << 20)
            receive = listener.expect(1, buffer)
            await client.send(1, b"\x07" * (3 << 20), eager=True)  # several DATA messages, no CTS
            assert await receive.wait(5) == 3 << 20 and buffer == bytearray(b"\x07" * (3 << 20))
            with pytest.raises(transport.TransferRejected, match="eager"):
                await client.send(2, b"\x01" * (2 << 20), eager=True)  # nothing posted: refused, bytes dropped
            late = bytearray(16)
            again = listener.expect(3, late)
            await client.send(3, b"z" * 16)  # the connection carries on
            assert await again.wait(5) == 16 and late == bytearray(b"z" * 16)
        finally:
            await client.close()
            await listener.close()

    run(main())
