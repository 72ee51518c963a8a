"""How messages are written: many at once (more buffers than one sendmsg takes), and a write
whose payload cannot be sealed leaves the connection usable (the write lock is not held forever,
and the sequence numbers of both ends stay in step)."""

from __future__ import annotations

import asyncio

import pytest

from kvferry import transport
from kvferry.transport import seal
from tests.transport.conftest import config, run


async def _pair(backend: str, received: list[bytes]):
    cfg = config(backend)
    listener = await transport.listen("127.0.0.1", 0, cfg, on_message=lambda c, p: received.append(bytes(p)))
    connection = await transport.connect("127.0.0.1", listener.port, cfg)
    return cfg, listener, connection


async def _arrived(received: list[bytes], count: int) -> None:
    async with asyncio.timeout(10):
        while len(received) < count:
            await asyncio.sleep(0.01)


def test_more_messages_in_one_write_than_sendmsg_takes(backend):
    """1,500 messages are 3,000 buffers: over IOV_MAX (1,024), they must still all arrive, in order."""
    async def main():
        received: list[bytes] = []
        _, listener, connection = await _pair(backend, received)
        payloads = [f"message {i}".encode() for i in range(1500)]
        await connection.send_message(*payloads)
        connection.post_message(*payloads)
        await _arrived(received, 3000)
        assert received == payloads + payloads
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


def test_a_seal_that_fails_does_not_hold_the_write_lock(monkeypatch):
    async def main():
        received: list[bytes] = []
        _, listener, connection = await _pair("tcp", received)
        real, calls = seal.Direction.payload_tag, []

        def failing_once(self, seq, data):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("checksum unit on fire")
            return real(self, seq, data)

        monkeypatch.setattr(seal.Direction, "payload_tag", failing_once)
        with pytest.raises(RuntimeError, match="on fire"):
            await connection.send_message(b"first")
        async with asyncio.timeout(5):  # the lock was released: the next write goes out
            await connection.send_message(b"second")
        await _arrived(received, 1)
        assert received == [b"second"] and not connection.closed
        await connection.close()
        await listener.close()

    run(main(), timeout=30)


def test_a_message_larger_than_a_read_piece_arrives_whole(backend):
    """A MSG's buffer grows as a stream's bytes arrive; a message backend (UCX) delivers it whole
    into one buffer (read in pieces there, the first piece would truncate it)."""
    async def main():
        received: list[bytes] = []
        _, listener, connection = await _pair(backend, received)
        payloads = [bytes(range(256)) * 800, b"after"]  # 200 KiB, then a small one behind it
        await connection.send_message(*payloads)
        await _arrived(received, 2)
        assert received == payloads
        await connection.close()
        await listener.close()

    run(main(), timeout=60)


def test_a_posted_message_says_when_it_is_out(backend):
    """``post_message(written=)`` calls back once the messages are handed to the link: at once on
    an idle connection; behind a write that holds the link, only after it (in posting order); for
    a message the socket cannot take at once, only when its last byte is out; never for messages
    a closed connection did not write."""
    async def main():
        received: list[bytes] = []
        _, listener, connection = await _pair(backend, received)
        told: list[str] = []
        connection.post_message(b"idle", written=lambda: told.append("idle"))
        assert told == ["idle"]
        await _arrived(received, 1)
        await connection._write_lock.acquire()  # another write holds the link
        for name in ("first", "second"):
            connection.post_message(name.encode(), written=lambda name=name: told.append(name))
        await asyncio.sleep(0.05)
        assert told == ["idle"] and received == [b"idle"]
        connection._write_lock.release()
        await _arrived(received, 3)
        async with asyncio.timeout(10):
            while len(told) < 3:
                await asyncio.sleep(0.01)
        assert told == ["idle", "first", "second"] and received == [b"idle", b"first", b"second"]
        large = bytes(range(256)) * (48 << 10)  # 12 MiB on an idle link: more than a socket takes at once
        connection.post_message(large, written=lambda: told.append("large"))
        if backend.startswith("tcp"):  # a stream backend writes what the socket takes, the rest later
            assert "large" not in told
        await _arrived(received, 4)
        async with asyncio.timeout(10):
            while len(told) < 4:
                await asyncio.sleep(0.01)
        assert told[3:] == ["large"] and received[3] == large
        await connection.close()
        connection.post_message(b"late", written=lambda: told.append("late"))
        await asyncio.sleep(0.1)
        assert told == ["idle", "first", "second", "large"]
        await listener.close()

    run(main(), timeout=60)


def test_a_control_write_that_fails_fails_the_connection(monkeypatch):
    """Messages queued behind a busy link are written by the connection's control task; an error
    there fails the connection (its transfers end), rather than leaving it open with nobody to
    write what is queued, and the posters never told."""
    async def main():
        received: list[bytes] = []
        _, listener, connection = await _pair("tcp", received)
        real = seal.Direction.payload_tag

        def failing(self, seq, data):
            raise RuntimeError("checksum unit on fire")

        await connection._write_lock.acquire()
        told: list[str] = []
        connection.post_message(b"queued", written=lambda: told.append("queued"))
        monkeypatch.setattr(seal.Direction, "payload_tag", failing)
        connection._write_lock.release()
        async with asyncio.timeout(5):
            while not connection.closed:
                await asyncio.sleep(0.01)
        monkeypatch.setattr(seal.Direction, "payload_tag", real)
        assert told == [] and received == []
        await listener.close()

    run(main(), timeout=30)


def test_data_out_of_order_fails_the_connection_not_a_receive_reported_whole():
    """A receive is whole when every byte came, not when as many bytes came: a peer that sends the
    first half twice (and the second never) loses its connection, and the receive fails."""
    from tests.rawpeer import RawPeer
    from kvferry.transport.wire import Message, MessageType

    async def main():
        cfg = config("tcp", secret=b"s" * 16)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        raw = await RawPeer.connect(f"127.0.0.1:{listener.port}", b"s" * 16, transport.handshake.Offer(cfg.protocol))
        try:
            await asyncio.sleep(0.1)
            buffer = bytearray(b"\xaa" * 2048)
            receive = next(iter(listener._connections)).grant(7, buffer, tell=False)
            half = Message(MessageType.DATA, 7, 0, 1024, 2048)
            await raw.link.send(raw.seal(half, bytes(1024)) + raw.seal(half, bytes(1024)))
            with pytest.raises(transport.TransportError):
                await receive.wait(5.0)
            assert buffer[1024:] == b"\xaa" * 1024
        finally:
            await raw.close()
            await listener.close()

    run(main())


def test_a_peer_that_asks_and_never_reads_fails_its_connection_not_this_process(monkeypatch):
    """DATA nobody granted is answered with a REJECT each; a peer that sends such headers and stops
    reading fills the queue of replies behind the full link: past its bound, the connection fails
    instead of the queue growing with every 80 bytes the peer sends."""
    import socket

    from kvferry.transport import connection as connection_module
    from kvferry.transport.wire import Message, MessageType

    monkeypatch.setattr(connection_module, "MAX_CONTROL_BACKLOG", 1 << 20)

    async def main():
        cfg = config("tcp", secret=b"s" * 16, op_timeout=60.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        client.link._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its kernel holds little
        client._reader.cancel()  # the peer stops reading
        await asyncio.sleep(0.1)
        server = next(iter(listener._connections))
        loop = asyncio.get_running_loop()
        try:
            async with client._write_lock:
                for start in range(0, 100_000, 1000):
                    headers = [(Message(MessageType.DATA, 1_000_000 + start + i, 0, 0, 0), None) for i in range(1000)]
                    try:
                        await asyncio.wait_for(loop.sock_sendall(client.link._sock, b"".join(client._parts(headers))), 10)
                    except (OSError, TimeoutError):
                        break  # closed by the listener: what this test waits for
                    if server.closed:
                        break
            await asyncio.wait_for(server.wait_closed(), 10)
            assert server._backlog < 2 << 20  # the bound, and what was read before the connection failed
        finally:
            await client.close()
            await listener.close()

    run(main())


def test_a_receive_posted_in_the_mailbox_that_times_out_leaves_its_connection_idle():
    """A peer that stalls mid-payload (its socket open, as one that vanished without a FIN): the
    receive fails at its deadline, and the connection it came on, with nothing else in flight, is
    closed as idle rather than held, with its slot, for as long as the socket stays open."""
    from kvferry.transport.wire import Message, MessageType

    async def main():
        cfg = config("tcp", secret=b"s" * 16, op_timeout=1.0, idle_timeout=1.0, close_timeout=0.5)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        receive = listener.expect(7, bytearray(1 << 20))
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        try:
            await client._write(Message(MessageType.RTS, 7, total=1 << 20))
            await asyncio.sleep(0.2)
            async with client._write_lock:
                parts = client._parts([(Message(MessageType.DATA, 7, 0, 1 << 20, 1 << 20), memoryview(bytes(1 << 20)))])
                await asyncio.get_running_loop().sock_sendall(client.link._sock, parts[0] + bytes(parts[1][:1000]))
            with pytest.raises(transport.TransportTimeout):
                await receive.wait(1.0)
            server = next(iter(listener._connections))
            await asyncio.wait_for(server.wait_closed(), 10)
        finally:
            await client.close()
            await listener.close()

    run(main())


def test_a_write_that_times_out_after_its_caller_left_is_not_an_unretrieved_error(caplog):
    """A caller cancelled mid-write (its transfer ended) leaves the write to finish in the
    background; when that write then times out (a peer that stopped reading), the connection fails
    and says why, and asyncio logs no 'Task exception was never retrieved'."""
    import gc
    import logging
    import threading

    from tests.transport.conftest import config

    stalled, resume = threading.Event(), threading.Event()
    ports: list[int] = []

    def receiver() -> None:  # its own loop, stopped while a message is being read
        async def main():
            def on_message(connection, payload):
                stalled.set()
                resume.wait(20)  # the loop stops reading here

            listener = await transport.listen("127.0.0.1", 0, config("tcp"), on_message=on_message)
            ports.append(listener.port)
            while not resume.is_set():
                await asyncio.sleep(0.05)
            await listener.close()

        asyncio.run(main())

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()

    async def main():
        while not ports:
            await asyncio.sleep(0.01)
        client = await transport.connect("127.0.0.1", ports[0], config("tcp", op_timeout=0.5, min_bytes_per_s=1e12))
        await client.send_message(b"stall")
        while not stalled.is_set():
            await asyncio.sleep(0.01)
        sending = asyncio.ensure_future(client.send_message(bytes(15 << 20)))  # more than the socket buffers hold
        await asyncio.sleep(0.1)
        sending.cancel()
        for _ in range(50):  # past the write's op_timeout
            if client.closed:
                break
            await asyncio.sleep(0.1)
        assert client.closed
        await client.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        try:
            asyncio.run(asyncio.wait_for(main(), 30))
            gc.collect()  # an unretrieved failure is logged when its task is collected
        finally:
            resume.set()
            thread.join(10)
            transport.shutdown_backends()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
