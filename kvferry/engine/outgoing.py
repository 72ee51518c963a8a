"""The sending side of one transfer: choose the codec, announce, send the chunks (small ones
inline behind the announce, the rest on their credits: ``streaming.py``) or write them straight
into a receiver's lent same-host memory (at once, where a standing lease of it is held), and wait
for the receiver's DONE."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvferry import codec as codecs, transport

from . import ipc, peer
from .context import TransferContext
from .errors import EngineError, PeerError, ProtocolViolation
from .leases import Held
from .links import Pair, PeerLink, describe
from .pipeline import runs_now
from .samehost import write_blocks
from .states import Event, On
from .streaming import Chunks, dropped, inline_count
from .transfers import Transfer, TransferSpec

log = logging.getLogger("kvferry.engine")

# A same-host GPU write of at least this many bytes is announced as soon as it is launched: its
# copy (~50 µs on NVLink) outlasts the announce's way to the receiver.
ANNOUNCE_AT_LAUNCH_BYTES = 16 << 20


class Outgoing:
    """Runs outgoing transfers (its task per transfer is ``run``) with the services of ``ctx``."""

    def __init__(self, ctx: TransferContext):
        self.ctx = ctx
        self.apply = ctx.driver.apply
        self.chunks = Chunks(ctx)
        # The codec a same-host write records as chosen: blocks as they are.
        self.identity = next(c.name for c in codecs.lossless() if c.capabilities.identity)

    async def run(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                  book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        """One transfer's task: ends it done, failed or cancelled (telling the peer why)."""
        try:
            await self._send(t, spec, pairs, candidates, book, address)
        except asyncio.CancelledError:
            if t.task is not asyncio.current_task() and not t.state.terminal:
                return  # sent again on a fresh connection by another task (``Driver.lost``)
            self.apply(t, Event(On.CANCEL, "Cancelled", "cancelled"))  # ended already, unless by the loop
        except Exception as exc:
            kind, reason = describe(exc)
            link = self.ctx.links.get(t.id)
            refused = link is not None and link.reply.done() and link.reply.exception() is exc
            if not t.state.terminal:
                log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self.apply(t, Event(On.PEER_FAIL if refused else On.FAIL, kind, reason))
        finally:
            if t.task is asyncio.current_task():
                self.ctx.links.drop(t)

    def start_inline(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                     book: tuple[str, Any, str] | None, address: tuple[str, int]) -> bool:
        """Send a transfer of host memory whose every chunk rides inline, here and now, on an open
        pooled connection: no task and no waiting; the receiver's DONE (or its refusal, the loss of
        the connection, or the deadline) ends it. False, with nothing done, if it does not qualify."""
        if any(p.region.tensor.is_cuda for p in pairs):
            return False
        connection = self.ctx.plane.pool.ready(*address)
        if connection is None:
            return False
        codec, book = self._choose(t, spec, pairs, candidates, book)
        plan = peer.plan_chunks(len(spec.src_blocks), tuple(p.blocks_per_chunk for p in pairs))
        if inline_count(plan, pairs, codec) < len(plan):
            return False
        self.apply(t, Event(On.DIAL))
        link = self.ctx.links.add(t, PeerLink(connection, reused=True))
        link.offer = self._offer(connection, spec, pairs, codec)  # the receiver may lend shared memory for later
        try:
            inline = self.chunks.inline(t, plan, pairs, codec, len(plan))
            announce = self._announce(t, spec, pairs, book, len(inline), link.offer is not None)
        except Exception as exc:  # the codec's or the layout's refusal: the transfer's, not the engine's
            self._replied(t, 0, _failed(exc), On.FAIL)
            return True
        connection.post_message(announce, *inline, written=functools.partial(self._deadline, t))
        self.apply(t, Event(On.ANNOUNCE_ALL))
        for stage in ("announced", "first_byte", "last_byte"):
            t.mark(stage)
        link.settle = functools.partial(self._replied, t, spec.measured_bytes(pairs))
        return True

    def start_leased(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                     address: tuple[str, int]) -> bool:
        """Write a small transfer, here and now, into memory the receiver lent this sidecar's open
        connection (a standing lease), then announce it behind the data (a large GPU write: as soon
        as it is launched): one message, ended by the receiver's DONE. False, with nothing done, if
        it does not qualify.

        The announce goes out before the transfer's own bookkeeping (its one move, link and
        deadline): the receiver's work starts that much sooner, and nothing can read the
        bookkeeping before this returns to the loop."""
        connection = self.ctx.plane.pool.ready(*address)
        raw, device = spec.raw_bytes(pairs), pairs[0].region.tensor.device
        if connection is None or not self.ctx.leases.holding(connection) or not runs_now(device, raw):
            return False
        helds = self._leases(connection, spec, pairs, candidates)
        if helds is None:
            return False
        self._same_host(t)
        end, at_launch = None, self._announces_at_launch(connection, device, raw)
        try:
            with self.ctx.leases.writing(connection, helds):
                if at_launch:
                    with self._launched(spec, pairs, helds) as (stream, end):
                        connection.post_message(self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITING,
                                                               end), written=functools.partial(self._deadline, t))
                        t.mark("announced")
                        stream.synchronize()  # the lease is not let go while the copy may still write
                else:
                    def written_announce(stream: torch.cuda.Stream | None) -> bytes:
                        self._write(spec, pairs, helds)(stream)
                        return self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITTEN)  # as the copy runs

                    announce = self.ctx.codec.call_now("encode", device, written_announce)
        except Exception as exc:  # the layout's or the memory's refusal: the transfer's, not the engine's
            self._replied(t, 0, _failed(PeerError(f"cannot write into the receiver's memory: {exc}")
                                        if isinstance(exc, RuntimeError) else exc), On.FAIL)
            return True
        for stage in ("first_byte", "last_byte"):
            t.mark(stage)
        if not at_launch:
            connection.post_message(announce, written=functools.partial(self._deadline, t))
            t.mark("announced")
        t.bytes_raw = raw
        link = self.ctx.links.add(t, PeerLink(connection, reused=True))
        self.apply(t, Event(On.WRITTEN))  # queued -> confirming: written and announced already
        link.settle = functools.partial(self._replied, t, 0)  # not a link speed: a same-host copy
        if end is not None:
            self._written(t, link, spec, end)
        return True

    def _announces_at_launch(self, connection: transport.Connection, device: torch.device, raw_bytes: int) -> bool:
        """Whether a same-host write is announced as soon as it is launched (WRITING): a GPU copy
        long enough for the announce's way to the receiver and its admission to hide behind it,
        to a receiver that has not said it cannot wait on this sidecar's events."""
        return (device.type == "cuda" and raw_bytes >= ANNOUNCE_AT_LAUNCH_BYTES
                and self.ctx.leases.waits_on_events(connection))

    @contextlib.contextmanager
    def _launched(self, spec: TransferSpec, pairs: list[Pair],
                  helds: list[Held]) -> Iterator[tuple[torch.cuda.Stream, ipc.WriteEnd]]:
        """The write launched on the encode stream, and the event recorded behind it. If the
        block raises, the copy is over (``CodecRunner.launching``) and the event goes back to the
        ring, kept alive: the receiver may still query it (``WriteEvents``)."""
        end = None
        try:
            with self.ctx.codec.launching("encode", pairs[0].region.tensor.device) as stream:
                self._write(spec, pairs, helds)(stream)
                end = self.ctx.events.record(stream)
                yield stream, end
        except BaseException:
            if end is not None:
                self.ctx.events.give(end)
            raise

    def _written(self, t: Transfer, link: PeerLink, spec: TransferSpec, end: ipc.WriteEnd) -> None:
        """The write announced at launch is finished here: its event may be recorded again, and a
        receiver that could not wait on it (its empty ACCEPT, now or later) is told WRITTEN, and
        is sent no more events."""
        self.ctx.events.give(end)

        def asked(accepted: asyncio.Future) -> None:
            if accepted.cancelled() or t.state.terminal:
                return
            link.connection.post_message(peer.pack(peer.Message(t.id, peer.Written(len(spec.dst_blocks)))))
            self.ctx.leases.refuse_events(link.connection)

        link.accepted.add_done_callback(asked)

    def _leases(self, connection: transport.Connection, spec: TransferSpec, pairs: list[Pair],
                candidates: list[str]) -> list[Held] | None:
        """The standing leases ``spec`` can be written under: it moves blocks as they are (raw
        asked for, or ``auto``'s choice), on no emulated link, into regions all lent on this
        connection. None otherwise."""
        if self.ctx.settings.emulated_link_gbps or spec.references is not None:
            return None
        if len(candidates) == 1 and not codecs.get(candidates[0]).capabilities.identity:
            return None
        return self.ctx.leases.held(connection, *spec.destinations(pairs))

    def _offer(self, connection: transport.Connection, spec: TransferSpec, pairs: list[Pair],
               codec: codecs.Codec) -> tuple[list[str], list[tuple[int, ...]], str] | None:
        """What to offer the receiver to write ourselves (its destinations, which it lends in its
        ACCEPT for this and later transfers), or None: only blocks as they are (raw asked for, or
        ``auto``), all on a GPU with CUDA IPC here or all in host memory, on no emulated link (the
        peer stands for a remote one, which only the wire reaches), and not declined on this
        connection."""
        on_gpu = [p.region.tensor.is_cuda for p in pairs]
        settings = self.ctx.settings
        destinations = spec.destinations(pairs)
        wanted = ((ipc.available() and all(on_gpu) or not any(on_gpu)) and not settings.emulated_link_gbps
                  and (spec.codec == "auto" or codec.capabilities.identity) and spec.references is None
                  and self.ctx.leases.offer_wanted(connection, destinations[0]))
        return destinations if wanted else None

    def _deadline(self, t: Transfer) -> None:
        """A transfer without a task fails if the receiver does not confirm in time, counted from
        when its announce is out (a busy connection may hold it back behind others' messages);
        called by the connection, which may have lost the transfer meanwhile (ended, or sent again
        on a fresh connection by a task)."""
        if t.state.terminal or t.task is not None:
            return
        timeout = self.ctx.settings.transfer_timeout
        late = Event(On.DEADLINE, "PeerError", f"the receiver did not confirm within {timeout:g} s")
        t.deadline = asyncio.get_running_loop().call_later(timeout, self.apply, t, late)

    def _replied(self, t: Transfer, raw_bytes: int, reply: asyncio.Future, failed: On = On.PEER_FAIL) -> None:
        """A transfer without a task ends: the receiver's DONE, or why there is none (``failed``:
        whose doing that is). Its link goes with its end (``Driver``)."""
        if t.state.terminal:
            self.ctx.links.drop(t)
            return  # cancelled or timed out first
        if reply.exception() is not None:
            kind, reason = describe(reply.exception())
            log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self.apply(t, Event(failed, kind, reason))
            return
        t.blocks_done = reply.result().blocks
        self.apply(t, Event(On.PEER_DONE))
        self.ctx.policy.observe_ratio(t.chosen_codec, t.bytes_raw, t.bytes_wire)
        self.ctx.policy.observe_transfer(t.peer, t.chosen_codec, raw_bytes, time.perf_counter() - t.submitted)

    def _choose(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                book: tuple[str, Any, str] | None) -> tuple[codecs.Codec, tuple[str, Any, str] | None]:
        """The codec for ``t`` (recorded on it, with why, and bound to each pair), and the named
        codebook entry if that is the chosen codec's."""
        if len(candidates) == 1:
            chosen, t.choice_reason = candidates[0], "requested"
        else:
            chosen, t.choice_reason = self.ctx.policy.choose(t.peer, spec.raw_bytes(pairs), self.ctx.chunk_bytes,
                                                             candidates)
        t.chosen_codec = chosen
        if book is not None and book[0] != chosen:
            book = None
        codec = codecs.get(chosen)
        t.lossy = not codec.lossless
        self.ctx.bind(codec, book[1] if book is not None else None, pairs)  # sets each pair's ``bound``
        return codec, book

    def _announce(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], book: tuple[str, Any, str] | None,
                  inline: int, offer: bool, flags: int = 0, end: ipc.WriteEnd | None = None) -> bytes:
        announce = peer.Announce(
            codec=t.chosen_codec, dtype=pairs[0].region.dtype, dst_blocks=spec.dst_blocks,
            pairs=tuple(peer.PairLayout(dst, p.region.block_shape, p.blocks_per_chunk, ref)
                        for (_, dst), p, (_, ref) in zip(spec.pairs, pairs, spec.references or [("", "")] * len(pairs))),
            codebook=spec.codebook or "", codebook_digest=peer.codebook_digest(book[2]) if book else bytes(8),
            inline_chunks=inline, host=ipc.host_id() if offer else bytes(16), flags=flags,
            event=end.handle if end is not None else b"", event_gpu=end.gpu if end is not None else b"")
        return peer.pack(peer.Message(t.id, announce))

    async def _send(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                    book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        self.apply(t, Event(On.DIAL))
        pooled = self.ctx.plane.pool.ready(*address)
        try:
            connection = await self.ctx.plane.pool.get(*address)
        except transport.TransportError as exc:
            raise PeerError(f"cannot reach {t.peer}: {type(exc).__name__}: {exc}") from exc
        link = self.ctx.links.add(t, PeerLink(connection, reused=connection is pooled))
        helds = self._leases(connection, spec, pairs, candidates)
        if helds is not None:
            self.apply(t, Event(On.LEASE))
            await self._write_same_host(t, spec, pairs, helds, leased=True)
            return
        codec, book = self._choose(t, spec, pairs, candidates, book)
        # On a slow link the plan is tapered: the first bytes leave, and the last are decoded, sooner.
        tapered = self.ctx.policy.tapers(t.peer, pairs[0].blocks_per_chunk * pairs[0].region.block_bytes,
                                         t.chosen_codec, pairs[0].region.tensor.is_cuda)
        plan = peer.plan_chunks(len(spec.src_blocks), tuple(p.blocks_per_chunk for p in pairs), tapered)
        link.offer = self._offer(connection, spec, pairs, codec)
        offer = link.offer is not None
        inline = [] if offer else self.chunks.inline(t, plan, pairs, codec, inline_count(plan, pairs, codec))
        wire_start = time.perf_counter()
        sharing = self.ctx.policy.begin_stream(t.peer)
        try:
            if await self._wire(t, spec, pairs, candidates, book, connection, link, codec, plan, inline, offer,
                                tapered):
                return
        finally:
            ended = self.ctx.policy.end_stream(t.peer)
        wire_s = time.perf_counter() - wire_start
        self.ctx.metrics.wire_seconds.inc(wire_s)
        self.ctx.policy.observe_link(t.peer, t.bytes_wire, wire_s, max(sharing[0], ended[0]))
        self.ctx.policy.observe_ratio(t.chosen_codec, t.bytes_raw, t.bytes_wire)
        # Done only when the receiver has written every block.
        done = await self._reply(link, self.ctx.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.apply(t, Event(On.PEER_DONE))
        self.ctx.policy.observe_transfer(t.peer, t.chosen_codec, spec.measured_bytes(pairs),
                                         time.perf_counter() - t.submitted, alone=sharing[1] == ended[1] == 1)

    async def _wire(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                    book: tuple[str, Any, str] | None, connection: transport.Connection, link: PeerLink,
                    codec: codecs.Codec, plan: list[tuple[int, int, int]], inline: list, offer: bool,
                    tapered: bool) -> bool:
        """Announce, then the bytes: inline, streamed, or written into memory an ACCEPT lent
        (True: that write ended the transfer, the receiver's DONE included)."""
        # The first streamed chunk of GPU memory is encoded on the GPU while its announce is written.
        first = None
        if not offer and len(inline) < len(plan) and pairs[0].region.tensor.is_cuda:
            pair_index, start, count = plan[len(inline)]
            first = asyncio.ensure_future(self.chunks.encode(t, codec, pairs[pair_index], start, count, len(inline)))
        with self.chunks.credits(connection, t, len(inline), len(plan)) as credits:
            return await self._announced(t, spec, pairs, candidates, connection, link, codec, plan, inline, offer,
                                         tapered, book, first, credits)

    async def _announced(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                         connection: transport.Connection, link: PeerLink, codec: codecs.Codec,
                         plan: list[tuple[int, int, int]], inline: list, offer: bool, tapered: bool,
                         book: tuple[str, Any, str] | None, first: asyncio.Future | None,
                         credits: dict[int, int]) -> bool:
        try:
            await connection.send_message(self._announce(t, spec, pairs, book, len(inline), offer,
                                                         peer.FLAG_TAPERED if tapered else 0), *inline)
        except BaseException:
            await dropped(first)
            raise
        self.apply(t, Event(On.OFFER if offer else On.ANNOUNCE_ALL if len(inline) == len(plan) else On.ANNOUNCE))
        t.mark("announced")
        if inline:
            t.mark("first_byte")
        if offer:
            accept = await self._accepted(link)
            if accept.targets:
                if len(accept.targets) != len(pairs):
                    raise ProtocolViolation(f"{len(accept.targets)} targets for {len(pairs)} region pairs")
                self.apply(t, Event(On.ACCEPT_LENT))
                helds = self._leases(connection, spec, pairs, candidates) or [
                    Held(dst, target, p.region.block_shape, p.region.dtype)
                    for (_, dst), p, target in zip(spec.pairs, pairs, accept.targets)]  # lost already: this once
                await self._write_same_host(t, spec, pairs, helds)
                return True
            self.apply(t, Event(On.ACCEPT))
        if len(inline) < len(plan):
            await self.chunks.stream(t, connection, link, plan, pairs, codec, len(inline), first, credits)
            self.apply(t, Event(On.SENT_LAST))
        t.mark("last_byte")
        return False

    async def _accepted(self, link: PeerLink) -> peer.Accept:
        """The receiver's ACCEPT (or its refusal, raised)."""
        timeout = self.ctx.settings.transfer_timeout
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait({link.accepted, link.reply}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise PeerError(f"the receiver did not answer the announce within {timeout:g} s") from None
        if link.reply.done() and link.reply.exception() is not None:
            raise link.reply.exception()
        if not link.accepted.done():
            raise ProtocolViolation("the receiver said DONE before it accepted")
        return link.accepted.result()

    async def _write_same_host(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], helds: list[Held],
                               leased: bool = False) -> None:
        """Write the blocks into the receiver's lent memory, then tell it and wait for its DONE:
        WRITTEN after an ACCEPT, or (``leased``: under a standing lease) the announce itself, which
        a large GPU write sends as soon as it is launched (``_write_announced``)."""
        link = self.ctx.links[t.id]
        raw = spec.raw_bytes(pairs)
        self._same_host(t)
        device = pairs[0].region.tensor.device
        at_launch = leased and self._announces_at_launch(link.connection, device, raw)
        announce = self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITTEN) if leased and not at_launch \
            else None
        end = None
        with self.ctx.leases.writing(link.connection, helds):
            try:
                if at_launch:
                    end = await self._write_announced(t, spec, pairs, helds, link)
                else:
                    await self.ctx.codec.call("encode", device, raw, self._write(spec, pairs, helds))
            except (RuntimeError, EngineError, transport.TransportTimeout) as exc:
                raise PeerError(f"cannot write into the receiver's memory: {exc}") from exc
            if announce is not None:  # ahead of a REVOKED that waited for this write: the memory is still lent
                await link.connection.send_message(announce)
                t.mark("announced")
        t.bytes_raw = raw
        t.mark("first_byte")
        t.mark("last_byte")
        if end is not None:
            self._written(t, link, spec, end)
        elif announce is None:
            await link.connection.send_message(peer.pack(peer.Message(t.id, peer.Written(len(spec.dst_blocks)))))
        self.apply(t, Event(On.WRITTEN))
        done = await self._reply(link, self.ctx.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.apply(t, Event(On.PEER_DONE))

    async def _write_announced(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], helds: list[Held],
                               link: PeerLink) -> ipc.WriteEnd:
        """Launch the write, announce it (WRITING) while it runs, and wait for it, the loop polling
        meanwhile. However this ends, the copy is over before the lease's write is."""
        with self._launched(spec, pairs, helds) as (_, end):
            await link.connection.send_message(self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITING, end))
            t.mark("announced")
            await transport.until_ready(end, timeout=self.ctx.settings.transfer_timeout, what="a same-host write")
        return end

    def _write(self, spec: TransferSpec, pairs: list[Pair], helds: list[Held]) -> functools.partial:
        return functools.partial(write_blocks, self.ctx.mapper, spec.src_blocks, spec.dst_blocks, pairs, helds)

    def _same_host(self, t: Transfer) -> None:
        t.chosen_codec = self.identity
        t.choice_reason = "same host: written straight into the receiver's memory (CUDA IPC or shared memory)"
        t.lossy = False

    async def _reply(self, link: PeerLink, timeout: float) -> peer.Done:
        if not link.reply.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(link.reply)
            except TimeoutError:
                if not link.reply.done():
                    raise PeerError(f"the receiver did not confirm within {timeout:g} s") from None
        return link.reply.result()



def _failed(exc: Exception) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future
