"""A sender's chunks: the small ones encoded inline for the announce's own write, the others
encoded while earlier ones are on the wire and each sent on its credit (the initial one, or the
receiver's CTS, expected a window ahead: ``peer.CREDIT_WINDOW``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator

import torch

from kvferry import codec as codecs, transport

from . import peer
from .context import TransferContext
from .errors import PeerError
from .links import Pair, PeerLink
from .spin import outlast
from .states import Event, On
from .transfers import Transfer


def inline_count(plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec) -> int:
    """How many leading chunks of ``plan`` may ride inline (host memory, each and all small)."""
    def sizes() -> Iterator[int]:
        for pair_index, _, blocks in plan:
            region = pairs[pair_index].region
            if region.tensor.is_cuda:
                return
            yield codec.capacity((blocks, *region.block_shape), region.tensor.dtype)

    return peer.inline_prefix(sizes())


class Chunks:
    """Encodes and sends the chunks of outgoing transfers, with the services of ``ctx``."""

    def __init__(self, ctx: TransferContext):
        self.ctx = ctx

    def inline(self, t: Transfer, plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec,
               count: int) -> list[bytes]:
        """The first ``count`` chunks (small, of host memory: see ``inline_count``), encoded on
        the event loop as CHUNK messages for the announce's write."""
        inline = []
        for index, (pair_index, start, blocks) in enumerate(plan[:count]):
            pair = pairs[pair_index]
            nbytes = blocks * pair.region.block_bytes
            frame = self.ctx.codec.encode_now(codec, pair.region.tensor, pair.ids[start:start + blocks], pair.bound,
                                              nbytes)
            frame = self._account(t, frame, nbytes, index)
            inline.append(peer.pack(peer.Message(t.id, peer.Chunk(index, memoryview(frame.numpy())))))
        return inline

    async def encode(self, t: Transfer, codec: codecs.Codec, pair: Pair, start: int, count: int,
                     index: int) -> torch.Tensor:
        """Chunk ``index`` (``count`` blocks of ``pair`` from ``start``), encoded by the codec runner."""
        nbytes = count * pair.region.block_bytes
        payload = await self.ctx.codec.encode(codec, pair.region.tensor, pair.ids[start:start + count], pair.bound,
                                              nbytes)
        return self._account(t, payload, nbytes, index)

    def _account(self, t: Transfer, payload: torch.Tensor, nbytes: int, index: int) -> torch.Tensor:
        """Count chunk ``index``'s bytes (the one place every encoded frame passes)."""
        t.bytes_raw += nbytes
        t.bytes_wire += payload.numel()
        self.ctx.metrics.chunks.labels("out").inc()
        return payload

    @contextlib.contextmanager
    def credits(self, connection: transport.Connection, t: Transfer, inline: int,
                chunks: int) -> Iterator[dict[int, int]]:
        """The credits of ``t``'s transport chunks past the initial credit, which the receiver
        sends unasked as it posts their buffers: expected from before the announce (they may come
        right behind it), ``CREDIT_WINDOW`` chunks ahead; yields chunk index -> tag of every chunk
        expected, and forgets those still expected when the transfer is done with them."""
        credits: dict[int, int] = {}
        _expect(connection, t, credits, range(inline + peer.EAGER_CHUNKS, min(chunks, inline + peer.CREDIT_WINDOW)))
        try:
            yield credits
        finally:
            connection.forget_credits(credits.values())  # those taken by their sends are gone already

    async def stream(self, t: Transfer, connection: transport.Connection, link: PeerLink,
                     plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec, inline: int,
                     first: asyncio.Future | None, credits: dict[int, int]) -> None:
        """The chunks after the inline ones, as transport transfers: each sent as soon as it is
        encoded and granted, the next encoded while earlier ones are on the wire, at most
        ``max_inflight_chunks`` encoded and unacknowledged. ``first``: the first one's encode,
        begun already; ``credits``: the chunks whose credits are expected (``credits``; each one
        sent expects the one ``CREDIT_WINDOW`` further)."""
        slots = asyncio.Semaphore(self.ctx.settings.max_inflight_chunks)
        sends: list[asyncio.Task] = []
        try:
            for index, (pair_index, start, count) in enumerate(plan):
                if index < inline:
                    continue
                await slots.acquire()
                if link.reply.done() or any(task.done() and task.exception() for task in sends):
                    break
                if index == inline and first is not None:
                    payload = await first
                else:
                    payload = await self.encode(t, codec, pairs[pair_index], start, count, index)
                self.ctx.metrics.inflight_chunks.inc()
                initial = index < inline + peer.EAGER_CHUNKS
                ahead = index + peer.CREDIT_WINDOW
                if ahead < len(plan):
                    _expect(connection, t, credits, range(ahead, ahead + 1))
                tag = peer.chunk_tag(t.id, index) if initial else credits[index]
                t.mark("first_byte")
                writing = asyncio.get_running_loop().create_future() if index == inline else None
                sends.append(asyncio.create_task(self._send(connection, t, index, tag, payload, slots, initial,
                                                            writing)))
                await _handed_on(sends[-1], writing)
            await _unless_refused(link, asyncio.gather(*sends))
        finally:
            for task in sends:
                task.cancel()
            await dropped(first)

    async def _send(self, connection: transport.Connection, t: Transfer, index: int, tag: int,
                    payload: torch.Tensor, slots: asyncio.Semaphore, initial: bool,
                    writing: asyncio.Future | None = None) -> None:
        """Send chunk ``index`` on its credit (the initial one, or the receiver's CTS: a CREDIT event)."""
        try:
            await connection.send(tag, payload,
                                  clearance=transport.Clearance.INITIAL if initial else transport.Clearance.CREDIT,
                                  granted=None if initial else functools.partial(self.ctx.driver.apply, t,
                                                                                 Event(On.CREDIT)),
                                  writing=writing)
        except transport.TransportError as exc:
            raise PeerError(f"chunk {index}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.ctx.metrics.inflight_chunks.dec()
            slots.release()


# Loop turns from a DATA write's start to its payload in the link's hands (the write's task,
# then its send's, whose worker threads are submitted at once).
_HAND_ON_TURNS = 2


async def _handed_on(send: asyncio.Task, writing: asyncio.Future | None) -> None:
    """Before the next chunk's encode takes the GPU: the first streamed chunk's send is let run
    until its payload is in the link's hands (its checksum on the GPU, its header written), or
    ends; a later one, a turn of the loop to launch its checksum. On a link slower than the GPU
    the first chunk's bytes are the fill of the whole pipeline."""
    turns = 1
    if writing is not None:
        await asyncio.wait({send, writing}, return_when=asyncio.FIRST_COMPLETED)
        turns = _HAND_ON_TURNS
    for _ in range(turns):
        await asyncio.sleep(0)


def _expect(connection: transport.Connection, t: Transfer, credits: dict[int, int], indices: range) -> None:
    for i in indices:
        credits[i] = peer.chunk_tag(t.id, i)
    connection.expect_credits(credits[i] for i in indices)


async def _unless_refused(link: PeerLink, work: asyncio.Future) -> None:
    """Await ``work``, but stop at once with the peer's refusal if that comes first. Stopped
    itself meanwhile (the transfer ended: its task cancelled), it drops ``work``: the sends its
    caller cancels then end it with an error nobody else would take."""
    try:
        await asyncio.wait({work, link.reply}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        drop(work)
        raise
    if link.reply.done() and link.reply.exception() is not None:
        drop(work)  # the peer's own word says more than a chunk it refused (that error, if any, taken)
        raise link.reply.exception()
    # DONE can be read before the sends wake up to their acknowledgements, which precede it.
    await work


async def dropped(work: asyncio.Future | None) -> None:
    """``drop``, then wait for ``work`` to end (GPU work it launched included: it reads the
    transfer's regions), through the caller's own cancellation, which is raised after."""
    if work is None:
        return
    drop(work)
    if await outlast(work):
        raise asyncio.CancelledError


def drop(work: asyncio.Future | None) -> None:
    """Cancel ``work`` if it is still running; any error it ended with, or ends with after all (a
    cancel asked is not a cancel done), is taken, not reported as never retrieved."""
    if work is None:
        return
    if not work.done():
        work.cancel()
    work.add_done_callback(_taken)


def _taken(work: asyncio.Future) -> None:
    if not work.cancelled():
        work.exception()
