"""What both sides of a transfer hold: its validated region pairs and its peer link."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvferry import transport

from .blocks import Ids
from .regions import Region


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


def describe(exc: BaseException) -> tuple[str, str]:
    """(error kind, reason): the kind is the class name, which metrics label and peers report."""
    return type(exc).__name__, str(exc)
