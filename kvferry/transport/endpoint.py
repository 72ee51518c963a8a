"""Opening connections: ``listen`` (accepting side), ``connect``, and a ``Pool`` that reuses
one live connection per peer."""

from __future__ import annotations

import asyncio
import contextlib

from . import handshake
from .config import TransportConfig
from .connection import Connection, Mailbox, OnMessage
from .errors import TransportClosed, TransportError
from .link import Link, backend_module, log, resolve_backend


class Listener:
    """Accepts connections; receives posted in ``mailbox`` match transfers from any of them."""

    def __init__(self, backend: str, config: TransportConfig, mailbox: Mailbox, on_message: OnMessage | None = None):
        self.backend = backend
        self.on_message = on_message
        self.mailbox = mailbox
        self.port = 0
        self._config = config
        self._handle = None
        self._connections: set[Connection] = set()
        self._closed = False

    async def _on_link(self, link: Link) -> None:
        if self._closed:
            await link.close()
            return
        try:
            await handshake.acceptor(link, self._config.secret, self._config.connect_timeout)
        except TransportError as exc:
            log.warning("refused a connection from %s: %s: %s", link.peer, type(exc).__name__, exc)
            return
        connection = Connection(link, self._config, self.mailbox, self.on_message)
        self._connections.add(connection)
        log.debug("accepted connection %d from %s", connection.id, connection.peer)
        try:
            await connection.wait_closed()  # ucxx keeps a link while its handler runs
        finally:
            self._connections.discard(connection)

    def expect(self, tag: int, buffer) -> object:
        """Post a receive for transfer ``tag`` (see ``Mailbox.expect``)."""
        return self.mailbox.expect(tag, buffer)

    async def close(self) -> None:
        """Stop accepting, close every accepted connection, then release the port.

        Connections close first: a backend may keep the port bound while a handler still runs.
        """
        self._closed = True
        await asyncio.gather(*(c.close() for c in list(self._connections)), return_exceptions=True)
        if self._handle is not None:
            await self._handle.close()


async def listen(host: str, port: int, config: TransportConfig, *, backend: str | None = None,
                 mailbox: Mailbox | None = None, on_message: OnMessage | None = None) -> Listener:
    """Start accepting transport connections on ``host:port`` (port 0: any free port). Each
    connection is authenticated (``config.secret``) before anything else is read from it.

    Raises:
        ConnectError: the port cannot be bound.
    """
    name = backend or resolve_backend(config)
    listener = Listener(name, config, mailbox or Mailbox(), on_message)
    listener._handle = await backend_module(name).listen(host, port, listener._on_link, config)
    listener.port = listener._handle.port
    return listener


async def connect(host: str, port: int, config: TransportConfig, *, backend: str | None = None,
                  mailbox: Mailbox | None = None, on_message: OnMessage | None = None) -> Connection:
    """Open a connection to a listener and authenticate both ends (``config.secret``).

    Raises:
        ConnectError: refused, unreachable, or not connected within ``connect_timeout``.
        AuthenticationFailed: the two ends do not share the peer secret.
    """
    name = backend or resolve_backend(config)
    link = await backend_module(name).connect(host, port, config)
    await handshake.connector(link, config.secret, config.connect_timeout)
    return Connection(link, config, mailbox or Mailbox(), on_message)


class Pool:
    """One live connection per peer, opened on first use and reopened after a failure."""

    def __init__(self, config: TransportConfig, *, backend: str | None = None, on_message: OnMessage | None = None):
        self._config = config
        self._on_message = on_message
        self._backend = backend or resolve_backend(config)
        self._connections: dict[tuple[str, int], Connection] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._closed = False

    async def get(self, host: str, port: int) -> Connection:
        """A live connection to ``host:port``.

        Raises:
            ConnectError: as ``connect``; TransportClosed: the pool is closed.
        """
        if self._closed:
            raise TransportClosed("connection pool is closed")
        key = (host, port)
        async with self._locks.setdefault(key, asyncio.Lock()):
            connection = self._connections.get(key)
            if connection is None or connection.closed:
                connection = await connect(host, port, self._config, backend=self._backend,
                                           on_message=self._on_message)
                self._connections[key] = connection
            return connection

    async def discard(self, connection: Connection) -> None:
        """Close ``connection`` and forget it (after an error the caller cannot recover from)."""
        for key, known in list(self._connections.items()):
            if known is connection:
                del self._connections[key]
        await connection.close()

    async def close(self) -> None:
        self._closed = True
        connections, self._connections = list(self._connections.values()), {}
        with contextlib.suppress(Exception):
            await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
