"""Lanes: the preamble's bytes, how payloads are cut, and a listener's bounds on lanes that never
make a link (real listener, real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
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
    assert data == b"KVFL" + bytes([2, 2, 4, 0]) + LINK_ID
    assert lanes.unpack_preamble(data) == (2, 4, LINK_ID)


@pytest.mark.parametrize("data", [
    b"KVFX" + bytes([2, 0, 2, 0]) + LINK_ID,  # magic
    b"KVFL" + bytes([1, 0, 2, 0]) + LINK_ID,  # version: lanes that split payloads in fixed pieces
    b"KVFL" + bytes([2, 0, 1, 0]) + LINK_ID,  # one lane is no lanes
    b"KVFL" + bytes([2, 0, 17, 0]) + LINK_ID,  # too many
    b"KVFL" + bytes([2, 3, 3, 0]) + LINK_ID,  # index past the count
])
def test_bad_preambles_are_refused(data):
    with pytest.raises(transport.ProtocolError):
        lanes.unpack_preamble(data)


def test_slice_header_golden_bytes():
    assert lanes.slice_header(0x0102030405, 0x10000) == bytes([5, 4, 3, 2, 1, 0, 0, 0, 0, 0, 1, 0])
    assert lanes.slice_header(0, 0) == bytes(12)
    stream = io.BytesIO(lanes.slice_header(3 << 20, 1 << 20) + lanes.slice_header(0, 0))
    read = lambda view: view.__setitem__(slice(None), stream.read(len(view)))  # noqa: E731
    assert lanes.read_slice(read) == (3 << 20, 1 << 20)
    assert lanes.read_slice(read) is None


@pytest.mark.parametrize("nbytes", [lanes.STRIPE_MIN, 256 << 20, (256 << 20) + 12345])
@pytest.mark.parametrize("count", [2, 3, 8])
def test_a_dealer_tiles_the_payload_and_its_slices_shrink_towards_the_end(nbytes, count):
    dealer = lanes.Dealer(nbytes, count)
    spans = list(iter(dealer.take, None))
    tally = lanes.Tally(nbytes)
    for span in spans:
        tally.take(*span)
    tally.check_whole()
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert max(size for _, size in spans) <= lanes.SLICE
    assert all(size % lanes.MIN_SLICE == 0 for _, size in spans[:-1])
    # the last few slices are small: the lanes end close together
    assert sum(size for _, size in spans[-count:]) <= max(nbytes // count, count * lanes.DEALT_FLOOR)
    assert dealer.take() is None


def test_dealt_is_for_large_payloads_on_several_lanes():
    assert not lanes.dealt(lanes.STRIPE_MIN - 1, 4) and not lanes.dealt(1 << 30, 1)
    assert lanes.dealt(lanes.STRIPE_MIN, 2)


@pytest.mark.parametrize("slices, why", [
    ([(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 1)], "outside"),  # past the end
    ([(0, 4096)], "at least"),  # a tiny slice inside the payload: a header per few bytes
    ([(0, 1 << 20), (0, 1 << 20), (1 << 20, 1 << 20)], "more slices"),  # the same bytes twice, then more
    ([(0, 1 << 20), (0, 1 << 20)], "overlap"),  # the same bytes twice
    ([(0, 1 << 20)], "ended at"),  # lanes ended early
    ([(1 << 20, 1 << 20)], "gap"),  # nothing for the start
])
def test_a_tally_refuses_what_a_payload_cannot_be(slices, why):
    tally = lanes.Tally(2 << 20)
    with pytest.raises(transport.ProtocolError, match=why):
        for span in slices:
            tally.take(*span)
        tally.check_whole()


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


def test_the_gathering_bounds_waiting_lanes_by_address_and_in_all():
    """Lanes 1... waiting for their link's lane 0 have a budget of their own: per address, and in
    all, where an address holding fewer closes the oldest lane-0-less group of the one holding the
    most; a group that never becomes whole is closed by its own timer, with no other lane coming."""
    async def main():
        gathering = lanes.Gathering(timeout=60, max_sockets=4, max_per_source=3)
        flood = [socket.socket() for _ in range(4)]
        first = gathering.add(b"a" * 16, 1, 3, flood[0], "198.18.0.2")
        gathering.add(b"a" * 16, 2, 3, flood[1], "198.18.0.2")
        gathering.add(b"b" * 16, 1, 2, flood[2], "198.18.0.2")
        with pytest.raises(transport.ProtocolError):  # a fourth from one address
            gathering.add(b"c" * 16, 1, 2, socket.socket(), "198.18.0.2")
        gathering.add(b"d" * 16, 1, 2, flood[3], "198.18.0.3")
        peer = socket.socket()
        gathering.add(b"e" * 16, 1, 2, peer, "198.18.0.4")  # all four taken: .2's oldest group goes
        assert isinstance(first.exception(), transport.ProtocolError)
        assert flood[0].fileno() == -1 and flood[1].fileno() == -1 and flood[2].fileno() != -1
        gathering.add(b"f" * 16, 1, 2, socket.socket(), "198.18.0.3")  # room again: four wait
        with pytest.raises(transport.ProtocolError):  # from the address holding the most: refused
            gathering.add(b"g" * 16, 1, 2, socket.socket(), "198.18.0.3")
        with pytest.raises(transport.ProtocolError):
            gathering.add(b"e" * 16, 1, 2, socket.socket(), "198.18.0.4")  # lane 1 twice
        with pytest.raises(transport.ProtocolError):
            gathering.add(b"e" * 16, 0, 2, socket.socket(), "198.18.0.5")  # lane 0 from another address
        done = gathering.add(b"e" * 16, 0, 2, socket.socket(), "198.18.0.4")
        assert done.result() == [peer] and peer.fileno() != -1
        gathering.drain()
        assert all(s.fileno() == -1 for s in flood)

        timed = lanes.Gathering(timeout=0.2)
        lone = socket.socket()
        waiting = timed.add(b"h" * 16, 1, 2, lone, "198.18.0.2")
        await asyncio.sleep(0.5)  # nothing else arrives: its timer closes it
        assert isinstance(waiting.exception(), transport.ProtocolError) and lone.fileno() == -1

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
        started = asyncio.get_running_loop().time()
        with pytest.raises(transport.TransportTimeout):
            if direction == "receive":  # lane 0 carries half and ends; lane 1 never sends its half
                half = lanes.slice_header(0, nbytes // 2) + bytes(nbytes // 2) + lanes.slice_header(0, 0)
                threading.Thread(target=pairs[0][1].sendall, args=(half,), daemon=True).start()
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


def _linked(lane_count: int, io_timeout: float = 5.0):
    """A TcpLink with ``lane_count`` lanes and the raw far ends of its sockets."""
    from kvferry.transport.tcp import TcpLink

    pairs = _socket_pairs(lane_count)
    link = TcpLink(pairs[0][0], io_timeout=io_timeout)
    link.add_lanes([near for near, _ in pairs[1:]])
    return link, [far for _, far in pairs]


def _read_slices(sock: socket.socket, into: bytearray) -> int:
    """A receiving lane written by hand: slices into ``into`` until the lane's end; its bytes."""
    carried = 0
    while True:
        header = sock.recv(lanes.SLICE_HEADER.size, socket.MSG_WAITALL)
        offset, size = lanes.SLICE_HEADER.unpack(header)
        if not size:
            return carried
        view = memoryview(into)[offset:offset + size]
        while view:
            view = view[sock.recv_into(view):]
        carried += size


def test_a_lane_that_stops_draining_hands_its_share_to_the_others():
    """Lane 1's reader waits until lane 0 has ended: with fixed halves the payload could not end
    until lane 1 drained; dealt slices go to lane 0 while lane 1's buffers are full."""
    async def main():
        link, far = _linked(2)
        nbytes = 96 << 20
        payload = bytes(random.Random(5).getrandbits(8) for _ in range(4096)) * (nbytes // 4096)
        got = bytearray(nbytes)
        carried = {}
        lane0_done = threading.Event()

        def lane(index: int) -> None:
            if index:
                lane0_done.wait(30)
            carried[index] = _read_slices(far[index], got)
            if not index:
                lane0_done.set()

        readers = [threading.Thread(target=lane, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()
        await link.send_rest([Striped(payload)])
        for reader in readers:
            reader.join(30)
        assert got == payload
        assert carried[0] + carried[1] == nbytes and carried[1] < nbytes // 3, carried
        await link.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("lane_slices, why", [
    ([[(0, 2 << 20), (0, 2 << 20)], []], "overlap"),  # lane 0 sends its slice twice, none the rest
    ([[(0, 2 << 20)], []], "ended at"),  # both lanes end with half the payload missing
    ([[(0, 2 << 20), (2 << 20, 2 << 20), (4 << 20, 1 << 20)], []], "outside"),  # past the end
    ([[(0, 1000), (1000, (4 << 20) - 1000)], []], "at least"),  # a header every few bytes
])
def test_a_peer_that_deals_a_payload_wrong_fails_it_in_time(lane_slices, why):
    async def main():
        link, far = _linked(2, io_timeout=2.0)
        nbytes = 4 << 20

        def send(index: int) -> None:
            stream = b"".join(lanes.slice_header(o, n) + bytes(n) for o, n in lane_slices[index])
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the failed link closes its end
                far[index].sendall(stream + lanes.slice_header(0, 0))

        senders = [threading.Thread(target=send, args=(index,), daemon=True) for index in range(2)]
        for sender in senders:
            sender.start()
        started = asyncio.get_running_loop().time()
        with pytest.raises(transport.ProtocolError, match=why):
            await link.recv_payload(memoryview(bytearray(nbytes)), striped=True)
        assert asyncio.get_running_loop().time() - started < 5
        await link.close()
        for sender in senders:
            await asyncio.to_thread(sender.join, 10)

    run(main(), timeout=30)


def test_a_dealt_payload_lands_whole_after_read_ahead_and_is_discarded_whole():
    """Lane 0's first bytes may already sit in the link's read-ahead with the header before
    them; a dealt payload, and a discarded one, leave the next message's bytes where they were."""
    async def main():
        link, far = _linked(3)
        nbytes = 6 << 20
        payload = random.Random(7).randbytes(nbytes)
        for index in range(3):
            spans = [(o, min(1 << 20, nbytes - o)) for o in range(index << 20, nbytes, 3 << 20)]
            stream = b"".join(lanes.slice_header(o, n) + payload[o:o + n] for o, n in spans)
            far[index].sendall(stream + lanes.slice_header(0, 0) + (b"next" if index == 0 else b""))
        got = bytearray(nbytes)
        assert await link.recv_payload(memoryview(got), striped=True)
        assert got == payload and await link.recv_header(4) == b"next"
        for index in range(3):  # the same again, dropped
            spans = [(o, min(1 << 20, nbytes - o)) for o in range(index << 20, nbytes, 3 << 20)]
            stream = b"".join(lanes.slice_header(o, n) + payload[o:o + n] for o, n in spans)
            far[index].sendall(stream + lanes.slice_header(0, 0) + (b"last" if index == 0 else b""))
        await link.discard(nbytes, striped=True)
        assert await link.recv_header(4) == b"last"
        await link.close()

    run(main(), timeout=30)


def test_a_listener_of_another_lanes_version_is_named_as_the_likely_cause():
    """A listener that does not speak this side's lanes closes them before the handshake (as one
    of lanes version 1 does): the dialer says so, rather than only that the peer hung up."""
    async def main():
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        loop = asyncio.get_running_loop()

        async def refuse_lanes():
            for _ in range(3):
                sock, _ = await loop.sock_accept(server)
                await loop.sock_recv(sock, lanes.PREAMBLE.size)
                sock.close()

        refusing = asyncio.ensure_future(refuse_lanes())
        with pytest.raises(transport.ConnectError, match="lanes version"):
            await transport.connect("127.0.0.1", server.getsockname()[1], config("tcp", secret=b"s", tcp_lanes=3))
        refusing.cancel()
        server.close()

    run(main(), timeout=30)


def test_a_peer_stalling_a_dealt_payload_holds_only_its_own_links_threads():
    """A peer with the secret announces a 64 MiB payload dealt over its 16 lanes and sends none of
    it: the lanes' reads wait in threads of that link's own, and the process's shared threads (which
    decode and copy for every other transfer) stay free meanwhile."""
    from kvferry.transport.wire import Message, MessageType

    async def main():
        cfg = config("tcp", secret=b"s" * 16, op_timeout=4.0, tcp_lanes=16)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        client = await transport.connect("127.0.0.1", listener.port, cfg)
        try:
            async with client._write_lock:
                header = client._parts([(Message(MessageType.DATA, 99, 0, 64 << 20, 64 << 20),
                                         memoryview(bytearray(64 << 20)))])[0]
                await asyncio.get_running_loop().sock_sendall(client.link._sock, header)
            await asyncio.sleep(0.3)
            await asyncio.wait_for(asyncio.to_thread(lambda: None), 1.0)
        finally:
            await client.close()
            await listener.close()

    run(main(), timeout=30)
