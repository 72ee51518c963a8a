"""Opening connections: ``listen`` (accepting side), ``connect``, and a ``Pool`` that reuses
one live connection per peer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter

from . import handshake, lanes
from .config import TransportConfig
from .connection import Connection, OnMessage
from .errors import ConnectError, LinkAbsorbed, PeerLost, TransportClosed, TransportError
from .backends import backend_module, resolve_backend
from .link import Link, RateLimitedLog, log
from .mailbox import Mailbox


class Listener:
    """Accepts connections; receives posted in ``mailbox`` match transfers from any of them.

    Connections still in the handshake have their own budget, apart from authenticated ones
    (``max_connections``): unauthenticated sockets cannot lock the peers out. At most
    ``max_handshaking_per_source`` handshake at once from one address; when all
    ``max_handshaking_connections`` are taken, a newcomer from an address holding fewer of them
    than the address holding the most closes that address's oldest one (fair shares: a flood
    from a few addresses cannot keep out another peer's handshake, which takes a round trip),
    else it is refused. Each handshake still ends at ``connect_timeout``.
    """

    def __init__(self, backend: str, config: TransportConfig, mailbox: Mailbox, on_message: OnMessage | None = None):
        self.backend = backend
        self.on_message = on_message
        self.mailbox = mailbox
        self.port = 0
        self._config = config
        self._handle = None
        self._connections: set[Connection] = set()
        self._authenticated = 0  # links past the handshake, connected
        self._handshaking: dict[Link, str | None] = {}  # link -> its source address, oldest first
        self._handshake_tasks: dict[Link, asyncio.Task] = {}  # link -> the handler running its handshake
        self._sources: Counter[str | None] = Counter()  # source address -> its links in the handshake
        self._closed = False
        self._refusals = RateLimitedLog(log)
        self._watchdog: asyncio.Task | None = None

    async def _on_link(self, link: Link) -> None:
        source = peer_host(link.peer)  # None: counted in the overall handshake budget only
        refusal, evicted = (None, None) if self._closed else self._admit(source)
        if self._closed or refusal:
            if refusal:
                self._refusals.warn(f"refused a connection from {link.peer}: {refusal}")
            await link.close()
            return
        self._handshaking[link] = source  # counted before anything awaits
        self._sources[source] += 1
        task = asyncio.current_task()
        if task is not None:
            self._handshake_tasks[link] = task
        try:
            if evicted is not None:  # its own handler closes its link, with nothing of its left waiting
                handler = self._handshake_tasks.get(evicted)
                if handler is not None:
                    handler.cancel()
                else:
                    await evicted.close()
            session = await handshake.acceptor(link, self._config.secret, self._config.connect_timeout,
                                               offer_of(self._config))
        except LinkAbsorbed:
            return
        except asyncio.CancelledError:  # made room for another, or the listener closes
            await link.close()
            raise
        except TransportError as exc:
            if link in self._handshaking:  # not closed to make room for another
                self._refusals.warn(f"refused a connection from {link.peer}: {type(exc).__name__}: {exc}")
            return
        finally:
            self._forget(link)
            self._handshake_tasks.pop(link, None)
        if self._closed or self._authenticated >= self._config.max_connections:
            if not self._closed:
                self._refusals.warn(f"refused a connection from {link.peer}: {self._authenticated} connections "
                                    "already (max_connections)")
            await link.close()
            return
        self._authenticated += 1
        try:
            await self._serve(link, session)
        finally:
            self._authenticated -= 1

    def _admit(self, source: str | None) -> tuple[str | None, Link | None]:
        """(why a handshake from ``source`` is refused, or None; the handshaking link to end for
        it, where fair)."""
        config = self._config
        if self._authenticated >= config.max_connections:
            return f"{self._authenticated} connections already (max_connections)", None
        if source is not None and self._sources[source] >= config.max_handshaking_per_source:
            return f"{self._sources[source]} handshakes from {source} already (max_handshaking_per_source)", None
        if len(self._handshaking) < config.max_handshaking_connections:
            return None, None
        heaviest = max(self._sources.values())
        if self._sources[source] >= heaviest:
            return f"{len(self._handshaking)} handshakes already (max_handshaking_connections)", None
        victim = next(link for link, s in self._handshaking.items() if self._sources[s] == heaviest)
        self._refusals.warn(f"closed a handshaking connection from {victim.peer} to make room "
                            "(max_handshaking_connections)")
        self._forget(victim)
        return None, victim

    def _forget(self, link: Link) -> None:
        if link in self._handshaking:
            source = self._handshaking.pop(link)
            self._sources[source] -= 1
            if not self._sources[source]:
                del self._sources[source]

    async def _serve(self, link: Link, session: handshake.Session) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._close_idle())
        connection = Connection(link, self._config, self.mailbox, session, self.on_message)
        self._connections.add(connection)
        log.debug("accepted connection %d from %s", connection.id, connection.peer)
        try:
            await connection.wait_closed()  # ucxx keeps a link while its handler runs
        finally:
            self._connections.discard(connection)

    async def _close_idle(self) -> None:
        """Close accepted connections silent for ``idle_timeout`` with nothing in flight (their
        senders reconnect on next use)."""
        period = max(0.05, self._config.idle_timeout / 4)
        while not self._closed:
            await asyncio.sleep(period)
            now = time.monotonic()
            idle = [c for c in self._connections if c.idle and now - c.last_activity > self._config.idle_timeout]
            for connection in idle:
                log.info("closing idle connection %d from %s", connection.id, connection.peer)
            # Side by side: each may take up to close_timeout, and one slow peer holds up no other.
            await asyncio.gather(*(connection.close() for connection in idle), return_exceptions=True)

    def expect(self, tag: int, buffer, defer_check: bool = False) -> object:
        """Post a receive for transfer ``tag`` (see ``Mailbox.expect``)."""
        return self.mailbox.expect(tag, buffer, defer_check)

    async def close(self) -> None:
        """Stop accepting, close every accepted connection, then release the port.

        Connections close first: a backend may keep the port bound while a handler still runs.
        """
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
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
        IncompatiblePeer: the two ends speak different versions or security modes.
    """
    name = backend or resolve_backend(config)
    link = await backend_module(name).connect(host, port, config)
    try:
        session = await handshake.connector(link, config.secret, config.connect_timeout, offer_of(config))
    except TransportError as exc:
        if not link.local:
            if isinstance(exc, PeerLost) and link.lanes > 1:
                raise _lanes_refused(host, port, link, exc) from exc
            raise
        # Whatever holds the listener's Unix name did not complete the handshake: its TCP address
        # is what the peer was named by, and gives the real answer.
        await link.close()
        log.warning("%s:%d: the handshake over its Unix socket failed (%s: %s); dialling TCP",
                    host, port, type(exc).__name__, exc)
        return await connect(host, port, dataclasses.replace(config, local_socket=False), backend=name,
                             mailbox=mailbox, on_message=on_message)
    return Connection(link, config, mailbox or Mailbox(), session, on_message)


def _lanes_refused(host: str, port: int, link: Link, exc: PeerLost) -> ConnectError:
    """A link of lanes closed before its handshake: a listener refuses lanes it does not speak
    that way, which the error says."""
    return ConnectError(f"{host}:{port} closed a link of {link.lanes} lanes before its handshake: {exc}. "
                        f"A peer of another lanes version (this side speaks {lanes.VERSION}) does that; "
                        "run one version on both sides, or one lane (tcp_lanes 1)")


def offer_of(config: TransportConfig) -> handshake.Offer:
    return handshake.Offer(config.protocol, config.encrypt)


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
            if connection is not None and self._stale(connection):  # start afresh rather than race the listener
                await connection.close()
            if connection is None or connection.closed:
                connection = await connect(host, port, self._config, backend=self._backend,
                                           on_message=self._on_message)
                self._connections[key] = connection
            return connection

    def ready(self, host: str, port: int) -> Connection | None:
        """The open connection to ``host:port`` if there is one that ``get`` would return as it
        is (so a caller that cannot wait may use it), else None."""
        connection = self._connections.get((host, port))
        if connection is None or connection.closed or self._closed or self._stale(connection):
            return None
        lock = self._locks.get((host, port))
        return None if lock is not None and lock.locked() else connection

    def _stale(self, connection: Connection) -> bool:
        """Idle for half the listener's idle timeout: it may be closing it just now."""
        return connection.idle and time.monotonic() - connection.last_activity > self._config.idle_timeout / 2

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


def peer_host(peer: str) -> str | None:
    """The address part of a link's ``host:port`` (``[v6]:port``) peer; None where the backend
    does not say (ucxx)."""
    host, sep, port = peer.rpartition(":")
    return host.strip("[]") if sep and host and port.isdigit() else None
