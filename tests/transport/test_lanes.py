"""Lanes: the preamble's bytes, how payloads are cut, and a listener's bounds on lanes that never
make a link (real listener, real sockets)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from kvferry import transport
from kvferry.transport import lanes
from kvferry.transport.link import Striped
from tests.transport.conftest import config, run

LINK_ID = bytes(range(16))


def test_preamble_golden_bytes():
    data = lanes.pack_preamble(2, 4, LINK_ID)
    assert data == b"KVFL" + bytes([1, 2, 4, 0]) + LINK_ID
    assert lanes.unpack_preamble(data) == (2, 4, LINK_ID)


@pytest.mark.parametrize("data", [
    b"KVFX" + bytes([1, 0, 2, 0]) + LINK_ID,  # magic
    b"KVFL" + bytes([2, 0, 2, 0]) + LINK_ID,  # version
    b"KVFL" + bytes([1, 0, 1, 0]) + LINK_ID,  # one lane is no lanes
    b"KVFL" + bytes([1, 0, 17, 0]) + LINK_ID,  # too many
    b"KVFL" + bytes([1, 3, 3, 0]) + LINK_ID,  # index past the count
])
def test_bad_preambles_are_refused(data):
    with pytest.raises(transport.ProtocolError):
        lanes.unpack_preamble(data)


@pytest.mark.parametrize("nbytes", [0, 1, lanes.STRIPE_MIN - 1, lanes.STRIPE_MIN, 256 << 20, (256 << 20) + 12345])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_stripes_cover_the_payload_in_order(nbytes, count):
    spans = lanes.stripes(nbytes, count)
    assert 1 <= len(spans) <= count
    assert spans[0][0] == 0 and sum(size for _, size in spans) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    if nbytes < lanes.STRIPE_MIN or count == 1:
        assert spans == [(0, nbytes)]


def test_a_link_whose_lanes_never_come_fails_in_time_and_the_listener_serves_on():
    async def main():
        cfg = config("tcp", secret=b"s", connect_timeout=1.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        loop = asyncio.get_running_loop()
        lonely = socket.create_connection(("127.0.0.1", listener.port))
        lonely.sendall(lanes.pack_preamble(0, 3, LINK_ID))  # lanes 1 and 2 never come
        lonely.setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(lonely, 1), 5) == b""  # closed by the handshake deadline
        lonely.close()
        for lane_count in (1, 4):
            good = await transport.connect("127.0.0.1", listener.port, config("tcp", secret=b"s", tcp_lanes=lane_count))
            await good.send_message(b"hello")
            await good.close()
        await listener.close()

    run(main(), timeout=30)


def test_a_lane_with_bytes_before_its_link_is_closed():
    async def main():
        cfg = config("tcp", secret=b"s", connect_timeout=2.0)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(("127.0.0.1", listener.port))
        sock.sendall(lanes.pack_preamble(1, 2, LINK_ID) + b"smuggled")
        sock.setblocking(False)
        assert await asyncio.wait_for(loop.sock_recv(sock, 1), 5) == b""
        sock.close()
        await listener.close()

    run(main(), timeout=30)


def test_the_gathering_bounds_waiting_links():
    async def main():
        gathering = lanes.Gathering(timeout=60, max_groups=2)
        socks = [socket.socket() for _ in range(3)]
        first = gathering.add(b"a" * 16, 1, 2, socks[0])
        gathering.add(b"b" * 16, 1, 2, socks[1])
        gathering.add(b"c" * 16, 1, 2, socks[2])  # evicts the oldest link: its lane is closed
        assert isinstance(first.exception(), transport.ProtocolError) and socks[0].fileno() == -1
        with pytest.raises(transport.ProtocolError):
            gathering.add(b"b" * 16, 1, 2, socket.socket())  # lane 1 twice
        with pytest.raises(transport.ProtocolError):
            gathering.add(b"b" * 16, 0, 3, socket.socket())  # another count
        done = gathering.add(b"c" * 16, 0, 2, socket.socket())
        assert done.result() == [socks[2]]
        gathering.drain()
        assert socks[1].fileno() == -1

    run(main(), timeout=10)


def _socket_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    server = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(n):
        near = socket.create_connection(server.getsockname())
        pairs.append((near, server.accept()[0]))
    server.close()
    return pairs


@pytest.mark.parametrize("direction", ["receive", "send"])
def test_a_stalled_lane_times_out_instead_of_hanging(direction):
    """Lanes 1... block in the kernel (a slice per call); a peer that stops sending or reading on
    one of them still ends the payload after the link's idle timeout."""
    from kvferry.transport.tcp import TcpLink

    async def main():
        pairs = _socket_pairs(2)
        link = TcpLink(pairs[0][0], io_timeout=0.5)
        link.add_lanes([pairs[1][0]])
        assert not pairs[0][0].getblocking() and pairs[1][0].getblocking()
        nbytes = 64 << 20
        spans = lanes.stripes(nbytes, 2)
        started = asyncio.get_running_loop().time()
        with pytest.raises(transport.TransportTimeout):
            if direction == "receive":  # lane 0's piece comes, lane 1's never
                threading.Thread(target=pairs[0][1].sendall, args=(bytes(spans[0][1]),), daemon=True).start()
                await link.recv_payload(memoryview(bytearray(nbytes)), striped=True)
            else:  # nobody reads: the socket buffers fill and the sends stall
                await link.send_rest([Striped(bytearray(nbytes))])
        assert asyncio.get_running_loop().time() - started < 5
        await link.close()
        for _, far in pairs:
            far.close()

    run(main(), timeout=30)


def test_auto_carries_links_over_tcp_without_an_rdma_device(tmp_path, monkeypatch):
    """Without RDMA, UCX would carry GPU payloads over its own TCP path, slower than the tcp
    backend's lanes: ``auto`` takes ucxx only where an RDMA device opens (and ucxx imports)."""
    import importlib.util

    from kvferry.transport import backends

    monkeypatch.setattr(backends, "RDMA_DEVICES", str(tmp_path / "uverbs*"))
    assert backends.resolve_backend(config("auto")) == "tcp"
    (tmp_path / "uverbs0").touch()
    assert backends.resolve_backend(config("auto")) == ("ucxx" if importlib.util.find_spec("ucxx") else "tcp")
    assert backends.resolve_backend(config("tcp")) == "tcp"
