"""A flood of idle unauthenticated sockets on a daemon's data port, each reopened as soon as it is
dropped, from several addresses, as many as the default ``max_connections``: senders that need a
new connection still get one (real daemons, tcp, token and peer secret on)."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from tests.engine.conftest import kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow


class Flood:
    """``per_source`` idle sockets from each of ``sources`` to ``address``, each reopened (from
    its address) when the listener closes or refuses it, until ``stop``."""

    def __init__(self, address: str, sources: list[str], per_source: int):
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.wanted = [source for source in sources for _ in range(per_source)]
        self.selector = selectors.DefaultSelector()
        self.reopened = 0
        self.most_open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()

    def _open(self, source: str) -> None:
        try:
            s = socket.create_connection(self.target, timeout=5, source_address=(source, 0))
        except OSError:
            return
        s.setblocking(False)
        self.selector.register(s, selectors.EVENT_READ, source)

    def _run(self) -> None:
        missing = list(self.wanted)
        while not self._stop.is_set():
            for source in missing:
                self._open(source)
            self.most_open = max(self.most_open, len(self.selector.get_map()))
            missing = []
            for key, _ in self.selector.select(timeout=0.05):
                try:
                    gone = key.fileobj.recv(4096) == b""
                except OSError:
                    gone = True
                if gone:
                    self.selector.unregister(key.fileobj)
                    key.fileobj.close()
                    missing.append(key.data)
                    self.reopened += 1
            if missing:
                time.sleep(0.02)  # reopen at once, but leave the two cores some air


def test_idle_unauthenticated_sockets_do_not_lock_senders_out(kv):
    env = {"KVFERRY_IDLE_TIMEOUT": "1"}  # a pooled connection idle for 0.5 s is reopened: each transfer connects anew
    b = spawn("tcp", env)
    a = None
    try:
        b.client.create_region("dst", 8, list(kv.shape[1:]), "bfloat16")
        sources = [f"127.0.0.{i}" for i in range(2, 10)]
        with Flood(b.data, sources, 32) as flood:  # 256 sockets: the default max_connections
            time.sleep(2)
            assert flood.most_open >= 64  # the flood holds at least the whole handshake budget
            a = spawn("tcp", env)
            a.client.region_from_tensor("src", kv[:8])
            states = []
            for i in range(4):
                transfer = a.client.submit("src", [2 * i, 2 * i + 1], b.data, "dst", [2 * i, 2 * i + 1],
                                           codec="raw")
                states.append(a.client.wait(transfer, timeout=60)["state"])
                time.sleep(1.2)  # idle past half of idle_timeout: the next transfer needs a new connection
            assert flood.reopened > 0  # the listener kept dropping the flood's sockets all along
        assert states == ["done"] * 4, states
        for i in range(8):
            assert b.client.get_block("dst", i) == a.client.get_block("src", i)
    finally:
        stop(*(d for d in (a, b) if d is not None))
