"""What both sides of a transfer hold: its validated region pairs and its peer link (``LinkTable``:
every running transfer's); and how the engine's data plane is configured (``data_plane``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvferry import transport

from . import peer
from .blocks import Ids
from .regions import Region
from .settings import Settings

if TYPE_CHECKING:
    from .transfers import Transfer

log = logging.getLogger("kvferry.engine")
CPU_MESSAGE_BYTES = 16 << 20
# A GPU sidecar dials four TCP lanes: GPU payloads over TCP moved 3.5 GB/s on one lane, 6.0 on four
# and 5.8 on eight (two H200s of one host, loopback; docs/decisions/025-tcp-lanes.md).
GPU_TCP_LANES = 4


@dataclass
class Pair:
    """A validated region pair with its block ids resolved once (the hot path only slices them)."""

    region: Region
    index: Ids  # this side's block ids, checked
    blocks_per_chunk: int
    reference: Region | None = None  # a predictor's KV for the same blocks (codecs that code against it)
    bound: Any = None  # the codec's codebook bound to this region's layout (``Codec.bind``)
    bound_for: str = ""  # the codec ``bound`` is for (submit binds a named codec once, to check it)
    # ``bound`` holds a codebook the region learned since its last transfer with the codec: its
    # first use builds tables at both ends, so the transfer's time is no speed to go by.
    fresh_book: bool = False

    @property
    def ids(self) -> torch.Tensor:
        """The block ids on the region's device."""
        return self.index.on(self.region.tensor.device)


@dataclass
class PeerLink:
    """The peer-protocol side of a transfer: its connection, and what the peer said last."""

    connection: transport.Connection
    reply: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    incoming: Any = None  # the receiving side's pipeline (incoming.Incoming)
    settle: Callable[[asyncio.Future], None] | None = None  # called with ``reply`` once it is set (inline sends)
    # A sender's same-host offer: (destination region names, block shapes, dtype), what a lease
    # lent in the ACCEPT is for.
    offer: tuple[list[str], list[tuple[int, ...]], str] | None = None
    # The connection was pooled from earlier transfers, not dialled for this one: if it turns out
    # dead before the peer said anything of this transfer, it may be sent again on a fresh one.
    reused: bool = False


class LinkTable:
    """Running transfers' peer links by transfer id, and each connection's transfers: messages
    about a transfer are taken from its own connection only, and losing a connection reaches every
    transfer on it. One close callback per connection, not per transfer (a pooled connection
    outlives millions of transfers)."""

    def __init__(self, on_lost: Callable[[transport.Connection, Exception], None]):
        self._links: dict[str, PeerLink] = {}
        self._watched: dict[transport.Connection, dict[str, Transfer]] = {}
        self._on_lost = on_lost

    def add(self, t: Transfer, link: PeerLink) -> PeerLink:
        self._links[t.id] = link
        watched = self._watched.get(link.connection)
        if watched is None:
            watched = self._watched[link.connection] = {}
            link.connection.on_close(self._on_lost)
        watched[t.id] = t
        return link

    def drop(self, t: Transfer) -> None:
        link = self._links.pop(t.id, None)
        if link is not None:
            self._watched.get(link.connection, {}).pop(t.id, None)

    def get(self, transfer_id: str) -> PeerLink | None:
        return self._links.get(transfer_id)

    def __getitem__(self, transfer_id: str) -> PeerLink:
        return self._links[transfer_id]

    def __len__(self) -> int:
        return len(self._links)

    def lost(self, connection: transport.Connection) -> list[tuple[Transfer, PeerLink]]:
        """The transfers that ran on ``connection``, with their links, forgotten by it."""
        transfers = self._watched.pop(connection, {}).values()
        return [(t, self._links[t.id]) for t in list(transfers) if t.id in self._links]


def describe(exc: BaseException) -> tuple[str, str]:
    """(error kind, reason): the kind is the class name, which metrics label and peers report."""
    return type(exc).__name__, str(exc)


def data_plane(settings: Settings, on_gpu: bool, chunk_bytes: int) -> tuple[transport.TransportConfig, str]:
    """The transport's configuration for these settings, and the backend it uses (logged when
    ucxx is set aside)."""
    # On a GPU each message costs a UCX rendezvous and Python work, so a frame travels whole;
    # host memory moves in 16 MiB pieces.
    message_bytes = settings.transport_chunk_bytes or (chunk_bytes + (1 << 20) if on_gpu else CPU_MESSAGE_BYTES)
    config = transport.TransportConfig(
        backend=settings.transport_backend, chunk_bytes=message_bytes,
        max_inflight_bytes=max(settings.transport_window_bytes, settings.max_inflight_chunks * message_bytes),
        op_timeout=settings.transfer_timeout, min_bytes_per_s=settings.min_peer_bytes_per_s,
        pace_bytes_per_s=settings.emulated_link_gbps * 1e9,
        secret=settings.peer_secret.encode(), max_connections=settings.max_connections,
        max_handshaking_connections=settings.max_handshaking_connections,
        max_handshaking_per_source=settings.max_handshaking_per_source,
        protocol=f"kvferry-peer/{peer.VERSION}", encrypt=settings.data_encryption == "on",
        idle_timeout=settings.idle_timeout, tcp_lanes=settings.tcp_lanes or (GPU_TCP_LANES if on_gpu else 1),
        # An emulated link stands for a remote peer, which only TCP reaches.
        local_socket=settings.local_socket and not settings.emulated_link_gbps,
        ucx_options={**transport.DEFAULT_UCX_OPTIONS, **settings.ucx_options},
        ucx_progress_mode=settings.ucx_progress_mode)
    backend = transport.resolve_backend(config)
    if backend == "ucxx" and not settings.peer_secret:
        # ucxx's listener binds every interface: without a secret only tcp keeps it on data_host.
        log.warning("transport: tcp, not ucxx (ucxx would listen on every interface; set a peer secret to use it)")
        backend = "tcp"
    elif backend == "ucxx" and settings.data_on_ipv6():
        log.warning("transport: tcp, not ucxx (ucxx listens on IPv4 only; the data address is IPv6)")
        backend = "tcp"
    return config, backend
