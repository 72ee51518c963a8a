"""The control lane's server: binary frames (``kvferry/engine/lane.py``) on a TCP port beside the
REST API, for the two calls an engine makes per request. Requests are answered by the same
handlers as the REST routes (``app.lane_request``); this module only frames, authenticates and
bounds them."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable

from kvferry.engine import lane
from kvferry.engine.engine import Engine
from kvferry.engine.errors import PayloadTooLarge, ProtocolViolation
from kvferry.engine.settings import Settings

log = logging.getLogger("kvferry.api")

HELLO_TIMEOUT = 10.0  # a connection that does not say HELLO within this long is closed
Dispatch = Callable[[Engine, str, str, bytes], Awaitable[tuple[int, bytes]]]


class LaneServer:
    """Serves lane connections for one engine: HELLO checked against the API's token (in constant
    time), then one request at a time per connection, each with the engine's deadlines."""

    def __init__(self, engine: Engine, settings: Settings, dispatch: Dispatch):
        self.engine, self.settings, self.dispatch = engine, settings, dispatch
        self.max_frame = min(lane.MAX_FRAME, settings.max_body_bytes + lane.HEADER_SIZE + 65536)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen where the API listens; returns the port (the OS picks one for ``lane_port`` 0)."""
        self._server = await asyncio.start_server(self._serve, self.settings.host, self.settings.lane_port,
                                                  limit=1 << 16)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._connections) >= self.settings.max_connections:
            await _refuse(writer, 0, 429, "Overloaded", f"{self.settings.max_connections} lane connections are open")
            return
        self._connections.add(task)
        tag = 0
        try:
            tag, hello = await self._read(reader, HELLO_TIMEOUT)
            if not isinstance(hello, lane.Hello):
                raise ProtocolViolation("a lane connection starts with HELLO")
            if self.settings.token and not hmac.compare_digest(hello.token.encode(), self.settings.token.encode()):
                await _refuse(writer, tag, 401, "Unauthorized", "missing or wrong token")
                return
            writer.write(lane.pack(tag, lane.Welcome()))
            while True:
                tag, request = await self._read(reader, self.settings.idle_timeout)
                if not isinstance(request, lane.Request):
                    raise ProtocolViolation(f"a {type(request).__name__} from a client")
                self.engine.spinner.touch()
                self.engine.metrics.lane_requests.labels(request.method).inc()
                status, content = await self.dispatch(self.engine, request.method, request.target, request.body)
                writer.write(lane.pack(tag, lane.Reply(status, content)))
                await writer.drain()  # a client that does not read its answers stops being read
        except (ProtocolViolation, PayloadTooLarge) as exc:
            self.engine.metrics.errors.labels(type(exc).__name__).inc()
            log.warning("closed a lane connection: %s", exc)
            too_large = isinstance(exc, PayloadTooLarge)
            await _refuse(writer, tag, 413 if too_large else 400, "PayloadTooLarge" if too_large else "BadRequest",
                          str(exc))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the client went away or idled out: nothing is owed to it
        finally:
            self._connections.discard(task)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, timeout: float) -> tuple[int, lane.Body]:
        async with asyncio.timeout(timeout):
            size = lane.frame_size(await reader.readexactly(4), self.max_frame)
        async with asyncio.timeout(self.settings.transfer_timeout):  # a frame that started must arrive
            return lane.unpack(await reader.readexactly(size))


async def _refuse(writer: asyncio.StreamWriter, tag: int, status: int, kind: str, detail: str) -> None:
    """Answer with an error and close."""
    with contextlib.suppress(ConnectionError, RuntimeError):
        writer.write(lane.pack(tag, lane.Reply(status, json.dumps({"error": kind, "detail": detail}).encode())))
        async with asyncio.timeout(1.0):
            await writer.drain()
    writer.close()
