"""Connections still in the handshake have a budget of their own, apart from authenticated ones:
idle unauthenticated sockets never lock a peer out (real listener, real sockets from several
loopback addresses)."""

from __future__ import annotations

import asyncio
import socket

from kvferry import transport
from tests.transport.conftest import config, run


async def _idle(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A socket that connects from ``source`` and never says a word."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _dropped(reader: asyncio.StreamReader, within: float) -> bool:
    """The listener closed this socket within ``within`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (TimeoutError, asyncio.TimeoutError):
        return False
    except OSError:
        return True


def test_idle_sockets_do_not_count_against_authenticated_connections():
    """The listener's ``max_connections`` counts authenticated connections only: a peer with the
    secret gets in while as many idle sockets as that hold their handshakes open."""
    async def main():
        cfg = config("tcp", secret=b"s", max_connections=4, max_handshaking_connections=8,
                     max_handshaking_per_source=8, connect_timeout=30.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        idle = [await _idle(listener.port, "127.0.0.2") for _ in range(4)]
        try:
            await asyncio.sleep(0.2)
            good = [await transport.connect("127.0.0.1", listener.port, cfg) for _ in range(4)]
            assert not any(await asyncio.gather(*(_dropped(r, 0.3) for r, _ in idle)))  # still handshaking
            # The fifth authenticated connection is over max_connections: closed.
            try:
                extra = await transport.connect("127.0.0.1", listener.port, cfg)
            except transport.TransportError:
                pass
            else:
                await asyncio.wait_for(extra.wait_closed(), 10)
            for connection in good:
                await connection.close()
        finally:
            for _, writer in idle:
                writer.close()
            await listener.close()

    run(main())


def test_one_address_holds_at_most_its_share():
    async def main():
        cfg = config("tcp", secret=b"s", max_handshaking_connections=8, max_handshaking_per_source=3,
                     connect_timeout=30.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        idle = [await _idle(listener.port, "127.0.0.2") for _ in range(5)]
        try:
            dropped = await asyncio.gather(*(_dropped(r, 2.0) for r, _ in idle))
            assert dropped == [False] * 3 + [True] * 2  # the fourth and fifth: closed at once
            good = await transport.connect("127.0.0.1", listener.port, cfg)  # another address: in
            await good.close()
        finally:
            for _, writer in idle:
                writer.close()
            await listener.close()

    run(main())


def test_a_full_budget_makes_room_from_the_address_holding_the_most():
    """All handshake slots taken by a flood from a few addresses: a newcomer from another address
    closes the oldest handshake of the address holding the most, and a real peer gets in; a flood
    address already holding the most is refused instead."""
    async def main():
        cfg = config("tcp", secret=b"s", max_handshaking_connections=6, max_handshaking_per_source=4,
                     connect_timeout=30.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        idle = []
        try:
            for source in ("127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.4"):
                idle.append(await _idle(listener.port, source))
            await asyncio.sleep(0.2)
            assert not any(await asyncio.gather(*(_dropped(r, 0.3) for r, _ in idle)))  # all six handshaking
            more = await _idle(listener.port, "127.0.0.2")  # the heaviest address asks again: refused
            assert await _dropped(more[0], 5.0)
            more[1].close()
            good = await transport.connect("127.0.0.1", listener.port, cfg)
            # 127.0.0.2's oldest made room; every other handshake goes on.
            assert await _dropped(idle[0][0], 5.0)
            assert not any(await asyncio.gather(*(_dropped(r, 0.3) for r, _ in idle[1:])))
            await good.send_message(b"hello")  # an authenticated connection that works
            await good.close()
        finally:
            for _, writer in idle:
                writer.close()
            await listener.close()

    run(main())


def test_handshakes_still_end_at_connect_timeout():
    async def main():
        cfg = config("tcp", secret=b"s", connect_timeout=0.5)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        try:
            reader, writer = await _idle(listener.port, "127.0.0.2")
            assert await _dropped(reader, 10.0)
            writer.close()
            with socket.create_connection(("127.0.0.1", listener.port), timeout=5):
                pass  # the slot it held is free again
            good = await transport.connect("127.0.0.1", listener.port, cfg)
            await good.close()
        finally:
            await listener.close()

    run(main())


def test_a_handshake_closed_to_make_room_leaves_nothing_behind_for_the_next_socket():
    """The handshake made room for is ended by its own handler: the next socket the listener accepts
    (which the system gives the freed descriptor) is watched like any other, so a peer connecting
    after a flood from several addresses gets in at once, each time."""
    async def main():
        cfg = config("tcp", secret=b"s", max_handshaking_connections=4, max_handshaking_per_source=2,
                     connect_timeout=3.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        flood = []
        try:
            for round_ in range(3):
                for i in range(6):  # silent, from six addresses, outside this loop: room is made twice a round
                    s = socket.create_connection(("127.0.0.1", listener.port), timeout=5,
                                                 source_address=(f"127.0.0.{2 + i}", 0))
                    flood.append(s)
                    await asyncio.sleep(0.05)
                good = await asyncio.wait_for(transport.connect("127.0.0.1", listener.port, cfg), 2.5)
                await good.send_message(b"hello")
                await good.close()
        finally:
            for s in flood:
                s.close()
            await listener.close()

    run(main())
