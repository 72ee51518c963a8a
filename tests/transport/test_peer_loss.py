"""A peer process killed mid-transfer fails every pending operation here within the timeout."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from kvferry import transport
from tests.transport.conftest import config, run

ROOT = Path(__file__).parents[2]
NBYTES = 512 << 20
TIMEOUT = 3.0


def _spawn(*args: str) -> subprocess.Popen:
    # Prepended, not replaced: where packages come from PYTHONPATH (the GPU hosts' carried
    # wheels), the peer process must find them too.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "tests.transport.peer", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_sender_killed_mid_stream_fails_the_receive(backend):
    async def main():
        cfg = config(backend, op_timeout=TIMEOUT)
        listener = await transport.listen("127.0.0.1", 0, cfg)
        receive = listener.expect(1, bytearray(NBYTES))
        peer = _spawn("send", backend, str(listener.port), str(NBYTES))
        try:
            deadline = time.monotonic() + 30
            while receive.received == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            assert 0 < receive.received < NBYTES, "the transfer should be under way"
            peer.kill()
            started = time.monotonic()
            try:
                await receive.wait(cfg.op_timeout)
                raise AssertionError("a receive completed from a killed sender")
            except (transport.PeerLost, transport.TransportTimeout):
                pass
            assert time.monotonic() - started < TIMEOUT + 2
            assert receive.received < NBYTES
        finally:
            peer.kill()
            peer.wait()
            await listener.close()

    run(main())


def test_receiver_killed_mid_stream_fails_the_send(backend):
    async def main():
        cfg = config(backend, op_timeout=TIMEOUT, chunk_bytes=64 << 10, max_inflight_bytes=128 << 10)
        peer = _spawn("recv", backend, str(NBYTES))
        try:
            port = next(int(line.split()[1]) for line in peer.stdout if line.startswith("PORT"))
            connection = await transport.connect("127.0.0.1", port, cfg)
            send = asyncio.create_task(connection.send(1, bytes(NBYTES)))
            deadline = time.monotonic() + 30
            while connection._window.used == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            peer.kill()
            started = time.monotonic()
            try:
                await send
                raise AssertionError("a send to a killed receiver reported success")
            except (transport.PeerLost, transport.TransportTimeout):
                pass
            assert time.monotonic() - started < TIMEOUT + 2
            assert connection.closed  # every later operation fails fast too
            try:
                await connection.send(2, b"x")
                raise AssertionError("send on a dead connection succeeded")
            except transport.TransportError:
                pass
        finally:
            peer.kill()
            peer.wait()

    run(main())
