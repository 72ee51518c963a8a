"""A transport peer in its own process, for tests that kill it mid-transfer.

    python -m tests.transport.peer send BACKEND PORT NBYTES    # connect and send one transfer
    python -m tests.transport.peer recv BACKEND NBYTES         # listen, print port, receive
"""

from __future__ import annotations

import asyncio
import sys

from kvferry import transport
from kvferry.transport import lanes

SMALL_STEPS = dict(chunk_bytes=64 << 10, max_inflight_bytes=128 << 10, op_timeout=60.0)


async def main(role: str, backend: str, *rest: str) -> None:
    if backend == "tcp-lanes":  # as tests.transport.conftest makes it
        lanes.STRIPE_MIN = 64 << 10
        config = transport.TransportConfig(backend="tcp", tcp_lanes=3, **SMALL_STEPS)
    elif backend == "tcp-unix":
        config = transport.TransportConfig(backend="tcp", local_socket=True, **SMALL_STEPS)
    else:
        config = transport.TransportConfig(backend=backend, **SMALL_STEPS)
    if role == "send":
        port, nbytes = int(rest[0]), int(rest[1])
        connection = await transport.connect("127.0.0.1", port, config)
        await connection.send(1, bytes(nbytes))
    else:
        listener = await transport.listen("127.0.0.1", 0, config)
        receive = listener.expect(1, bytearray(int(rest[0])))
        print(f"PORT {listener.port}", flush=True)
        await receive.wait(60)
    await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
