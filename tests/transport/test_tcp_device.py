"""The socket half of staging device payloads over TCP (the worker thread's calls on a
non-blocking socket), on the CPU: complete transfers, a deadline without progress, a vanished peer."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvferry.transport import PeerLost, TransportTimeout
from kvferry.transport.tcp_device import _recv_all, _send_parts


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_send_parts_and_recv_all_move_more_than_the_socket_buffer():
    a, b = _pair()
    data = os.urandom(8 << 20)
    got = bytearray(len(data))
    sender = threading.Thread(target=_send_parts, args=(a, [data[:5], memoryview(data)[5:]], 10.0))
    sender.start()
    _recv_all(b, memoryview(got), 10.0)
    sender.join()
    assert got == data


def test_recv_all_gives_up_after_its_timeout_without_progress():
    a, b = _pair()
    a.send(b"abc")
    with pytest.raises(TransportTimeout, match="no progress"):
        _recv_all(b, memoryview(bytearray(10)), 0.2)


def test_send_parts_gives_up_when_the_peer_reads_nothing():
    a, _b = _pair()
    with pytest.raises(TransportTimeout):
        _send_parts(a, [bytes(64 << 20)], 0.2)


def test_recv_all_reports_a_peer_that_closed():
    a, b = _pair()
    a.send(b"abc")
    a.close()
    with pytest.raises(PeerLost):
        _recv_all(b, memoryview(bytearray(10)), 5.0)
