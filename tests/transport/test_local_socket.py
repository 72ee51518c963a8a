"""Same-host peers over the tcp backend's Unix socket: which peers take it, what it carries, and
what happens when its name is not the listener's."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import torch

from kvferry import transport
from kvferry.transport import lanes
from kvferry.transport.tcp import is_own_address, local_name

from .conftest import config, run

SECRET = b"local secret"


def _config(**overrides) -> transport.TransportConfig:
    return config("tcp", secret=SECRET, **overrides)


async def _round_trip(listener: transport.Listener, connection: transport.Connection, nbytes: int) -> None:
    """A message and a payload of ``nbytes`` from ``connection`` land whole at ``listener``."""
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    landed = torch.zeros_like(payload)
    receive = listener.expect(7, landed.numpy())
    await connection.send(7, payload.numpy())
    await receive.wait(10)
    assert torch.equal(landed, payload)


def test_a_peer_at_an_address_of_this_host_is_dialled_over_the_listeners_unix_socket(monkeypatch):
    monkeypatch.setattr(lanes, "STRIPE_MIN", 64 << 10)

    async def main():
        listener = await transport.listen("127.0.0.1", 0, _config(local_socket=True))
        for lane_count in (1, 3):
            connection = await transport.connect("127.0.0.1", listener.port,
                                                 _config(local_socket=True, tcp_lanes=lane_count))
            assert connection.peer == f"unix:{listener.port}"
            assert connection.link.local and connection.link.lanes == lane_count
            await _round_trip(listener, connection, (3 << 20) + 5)  # striped over the lanes where there are several
            accepted = next(iter(listener._connections))
            assert accepted.peer == f"unix:{listener.port}"
            await connection.close()
            for _ in range(100):  # the listener lets the closed connection go
                if not listener._connections:
                    break
                await asyncio.sleep(0.02)
        await listener.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("listens, dials", [(False, True), (True, False)])
def test_either_end_without_it_keeps_to_tcp(listens, dials):
    async def main():
        listener = await transport.listen("127.0.0.1", 0, _config(local_socket=listens))
        connection = await transport.connect("127.0.0.1", listener.port, _config(local_socket=dials))
        assert connection.peer.startswith("127.0.0.1:") and not connection.link.local
        await _round_trip(listener, connection, 1 << 16)
        await connection.close()
        await listener.close()

    run(main(), timeout=30)


def test_a_listener_on_every_address_is_reached_over_its_unix_socket_by_any_of_its_addresses():
    async def main():
        listener = await transport.listen("0.0.0.0", 0, _config(local_socket=True))
        connection = await transport.connect("127.0.0.1", listener.port, _config(local_socket=True))
        assert connection.peer == f"unix:{listener.port}"
        await _round_trip(listener, connection, 1 << 10)
        await connection.close()
        await listener.close()

    run(main(), timeout=30)


def test_only_this_namespaces_own_addresses_take_the_unix_socket():
    assert is_own_address(socket.AF_INET, "127.0.0.1")
    assert not is_own_address(socket.AF_INET, "198.19.255.254")  # assigned to nothing here
    assert local_name("0.0.0.0", 5) == local_name("::", 5) == "\0kvferry/*:5"
    assert local_name("127.0.0.1", 5) == "\0kvferry/127.0.0.1:5"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("squatter", ["closes", "stays silent"])
def test_a_name_held_by_another_socket_leaves_the_listener_on_tcp_and_the_dialler_falls_back(squatter, caplog):
    """Whatever holds the name first keeps it: the listener says so and serves on TCP; a dialler
    that reaches the holder fails its handshake there (at once, or at ``connect_timeout``) and
    dials TCP."""
    caplog.set_level(logging.WARNING, logger="kvferry.transport")

    async def main():
        port = _free_port()
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        holder.bind(local_name("127.0.0.1", port))
        holder.listen(8)
        holder.setblocking(False)
        loop = asyncio.get_running_loop()

        async def close_each() -> None:
            while True:
                sock, _ = await loop.sock_accept(holder)
                sock.close()

        closing = asyncio.ensure_future(close_each()) if squatter == "closes" else None
        listener = await transport.listen("127.0.0.1", port, _config(local_socket=True))
        assert any("is taken" in r.getMessage() for r in caplog.records)
        connection = await transport.connect("127.0.0.1", port, _config(local_socket=True, connect_timeout=1.0))
        assert connection.peer.startswith("127.0.0.1:") and not connection.link.local
        assert any("dialling TCP" in r.getMessage() for r in caplog.records)
        await _round_trip(listener, connection, 1 << 12)
        await connection.close()
        await listener.close()
        if closing is not None:
            closing.cancel()
        holder.close()

    run(main(), timeout=30)


def test_the_unix_name_is_released_with_the_listener():
    async def main():
        listener = await transport.listen("127.0.0.1", 0, _config(local_socket=True))
        port = listener.port
        await listener.close()
        again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        again.bind(local_name("127.0.0.1", port))  # free again: a restarted daemon takes it
        again.close()

    run(main(), timeout=30)
