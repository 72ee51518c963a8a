"""The sending side of one transfer: choose the codec, announce, stream the chunks (small ones
inline behind the announce, the rest as transport transfers, encoded while earlier ones are on the
wire) or write them straight into a receiver's lent same-host memory (at once, where a standing
lease of it is held), and wait for the receiver's DONE."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvferry import codec as codecs, transport
from kvferry.codec import blockcopy

from . import ipc, peer
from .blocks import Ids
from .errors import EngineError, PeerError, ProtocolViolation
from .leases import Held
from .links import Pair, PeerLink, describe
from .pipeline import runs_now
from .transfers import State, Transfer

if TYPE_CHECKING:
    from .engine import Engine, TransferSpec

log = logging.getLogger("kvferry.engine")
FEW_BLOCKS = 4  # a same-host write of at most this many listed blocks copies them one by one


class Outgoing:
    """Runs outgoing transfers for an engine (its task per transfer is ``run``)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def run(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                  book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        """One transfer's task: ends it done, failed or cancelled (telling the peer why)."""
        try:
            await self._send(t, spec, pairs, candidates, book, address)
        except asyncio.CancelledError:
            if t.task is not asyncio.current_task() and not t.state.terminal:
                return  # sent again on a fresh connection by another task (``Engine.lost``)
            state, kind, reason = self.engine.aborted(t)
            self.engine.end(t, state, kind, reason, peer.Cancel(reason))
        except Exception as exc:
            kind, reason = describe(exc)
            log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self.engine.end(t, State.FAILED, kind, reason, peer.Cancel(f"{kind}: {reason}"))
        finally:
            if t.task is asyncio.current_task():
                self.engine.unlink(t)

    def start_inline(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                     book: tuple[str, Any, str] | None, address: tuple[str, int]) -> bool:
        """Send a transfer of host memory whose every chunk rides inline, here and now, on an open
        pooled connection: no task and no waiting; the receiver's DONE (or its refusal, the loss of
        the connection, or the deadline) ends it. False, with nothing done, if it does not qualify."""
        if any(p.region.tensor.is_cuda for p in pairs):
            return False
        connection = self.engine.pool.ready(*address)
        if connection is None:
            return False
        codec, book = self._choose(t, spec, pairs, candidates, book)
        plan = peer.plan_chunks(len(spec.src_blocks), tuple(p.blocks_per_chunk for p in pairs))
        if self._inline_count(plan, pairs, codec) < len(plan):
            return False
        t.move(State.RUNNING)
        link = self.engine.link(t, PeerLink(connection, reused=True))
        link.offer = self._offer(connection, spec, pairs, codec)  # the receiver may lend shared memory for later
        try:
            inline = self._inline_chunks(t, plan, pairs, codec, len(plan))
            announce = self._announce(t, spec, pairs, book, len(inline), link.offer is not None)
        except Exception as exc:  # the codec's or the layout's refusal: the transfer's, not the engine's
            self._replied(t, 0, _failed(exc))
            return True
        connection.post_message(announce, *inline)
        for stage in ("announced", "first_byte", "last_byte"):
            t.mark(stage)
        timeout = self.engine.settings.transfer_timeout
        t.deadline = asyncio.get_running_loop().call_later(
            timeout, self.engine.abort, t, State.FAILED, "PeerError", f"the receiver did not confirm within {timeout:g} s")
        link.settle = functools.partial(self._replied, t, _measured_bytes(spec, pairs))
        return True

    def start_leased(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                     address: tuple[str, int]) -> bool:
        """Write a small transfer, here and now, into memory the receiver lent this sidecar's open
        connection (a standing lease), then announce it behind the data: one message, ended by the
        receiver's DONE. False, with nothing done, if it does not qualify."""
        connection = self.engine.pool.ready(*address)
        if connection is None or not self.engine.leases.holding(connection) \
                or not runs_now(pairs[0].region.tensor.device, _raw_bytes(spec, pairs)):
            return False
        helds = self._leases(connection, spec, pairs, candidates)
        if helds is None:
            return False
        t.move(State.RUNNING)
        link = self.engine.link(t, PeerLink(connection, reused=True))
        self._same_host(t)
        try:
            announce = self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITTEN)
            with self.engine.leases.writing(connection, helds):
                self.engine.codec.call_now("encode", pairs[0].region.tensor.device,
                                           functools.partial(self._write_blocks, spec, pairs, helds))
        except Exception as exc:  # the layout's or the memory's refusal: the transfer's, not the engine's
            self._replied(t, 0, _failed(PeerError(f"cannot write into the receiver's memory: {exc}")
                                        if isinstance(exc, RuntimeError) else exc))
            return True
        t.bytes_raw = _raw_bytes(spec, pairs)
        for stage in ("first_byte", "last_byte"):
            t.mark(stage)
        connection.post_message(announce)
        t.mark("announced")
        timeout = self.engine.settings.transfer_timeout
        t.deadline = asyncio.get_running_loop().call_later(
            timeout, self.engine.abort, t, State.FAILED, "PeerError", f"the receiver did not confirm within {timeout:g} s")
        link.settle = functools.partial(self._replied, t, 0)  # not a link speed: a same-host copy
        return True

    def _leases(self, connection: transport.Connection, spec: TransferSpec, pairs: list[Pair],
                candidates: list[str]) -> list[Held] | None:
        """The standing leases ``spec`` can be written under: it moves blocks as they are (raw
        asked for, or ``auto``'s choice), on no emulated link, into regions all lent on this
        connection. None otherwise."""
        if self.engine.settings.link_gbps or spec.references is not None:
            return None
        if len(candidates) == 1 and not getattr(codecs.get(candidates[0]), "identity", False):
            return None
        return self.engine.leases.held(connection, *_destinations(spec, pairs))

    def _offer(self, connection: transport.Connection, spec: TransferSpec, pairs: list[Pair],
               codec: codecs.Codec) -> tuple[list[str], list[tuple[int, ...]], str] | None:
        """What to offer the receiver to write ourselves (its destinations, which it lends in its
        ACCEPT for this and later transfers), or None: only blocks as they are (raw asked for, or
        ``auto``), all on a GPU with CUDA IPC here or all in host memory, on no emulated link or
        injected wire fault (the peer stands for a remote one, which only the wire reaches), and not
        declined on this connection."""
        on_gpu = [p.region.tensor.is_cuda for p in pairs]
        settings = self.engine.settings
        destinations = _destinations(spec, pairs)
        wanted = ((ipc.available() and all(on_gpu) or not any(on_gpu)) and not settings.link_gbps
                  and settings.fault_corrupt_chunk < 0
                  and (spec.codec == "auto" or getattr(codec, "identity", False)) and spec.references is None
                  and self.engine.leases.offer_wanted(connection, destinations[0]))
        return destinations if wanted else None

    def _replied(self, t: Transfer, raw_bytes: int, reply: asyncio.Future) -> None:
        """An inline transfer's end: the receiver's DONE, or why there is none."""
        self.engine.unlink(t)
        if t.state.terminal:
            return  # cancelled or timed out first
        if reply.exception() is not None:
            kind, reason = describe(reply.exception())
            log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self.engine.finish(t, State.FAILED, kind, reason)
            return
        t.blocks_done = reply.result().blocks
        self.engine.finish(t, State.DONE)
        self.engine.policy.observe_ratio(t.chosen_codec, t.bytes_raw, t.bytes_wire)
        self.engine.policy.observe_transfer(t.peer, t.chosen_codec, raw_bytes, time.perf_counter() - t.submitted)

    def _choose(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                book: tuple[str, Any, str] | None) -> tuple[codecs.Codec, tuple[str, Any, str] | None]:
        """The codec for ``t`` (recorded on it, with why, and bound to each pair), and the named
        codebook entry if that is the chosen codec's."""
        if len(candidates) == 1:
            chosen, t.choice_reason = candidates[0], "requested"
        else:
            chosen, t.choice_reason = self.engine.policy.choose(t.peer, _raw_bytes(spec, pairs), self.engine.chunk_bytes,
                                                                candidates)
        t.chosen_codec = chosen
        if book is not None and book[0] != chosen:
            book = None
        codec = codecs.get(chosen)
        t.lossy = not codec.lossless
        self.engine.bind(codec, book[1] if book is not None else None, pairs)  # sets each pair's ``bound``
        return codec, book

    def _announce(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], book: tuple[str, Any, str] | None,
                  inline: int, offer: bool, flags: int = 0) -> bytes:
        announce = peer.Announce(
            codec=t.chosen_codec, dtype=pairs[0].region.dtype, dst_blocks=spec.dst_blocks,
            pairs=tuple(peer.PairLayout(dst, p.region.block_shape, p.blocks_per_chunk, ref)
                        for (_, dst), p, (_, ref) in zip(spec.pairs, pairs, spec.references or [("", "")] * len(pairs))),
            codebook=spec.codebook or "", codebook_digest=peer.codebook_digest(book[2]) if book else bytes(8),
            inline_chunks=inline, host=ipc.host_id() if offer else bytes(16), flags=flags)
        return peer.pack(peer.Message(t.id, announce))

    async def _send(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                    book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        t.move(State.RUNNING)
        pooled = self.engine.pool.ready(*address)
        try:
            connection = await self.engine.pool.get(*address)
        except transport.TransportError as exc:
            raise PeerError(f"cannot reach {t.peer}: {type(exc).__name__}: {exc}") from exc
        link = self.engine.link(t, PeerLink(connection, reused=connection is pooled))
        helds = self._leases(connection, spec, pairs, candidates)
        if helds is not None:
            await self._write_same_host(t, spec, pairs, helds, leased=True)
            return
        codec, book = self._choose(t, spec, pairs, candidates, book)
        # On a slow link the plan is tapered: the first bytes leave, and the last are decoded, sooner.
        tapered = self.engine.policy.tapers(t.peer, pairs[0].blocks_per_chunk * pairs[0].region.block_bytes,
                                            t.chosen_codec)
        plan = peer.plan_chunks(len(spec.src_blocks), tuple(p.blocks_per_chunk for p in pairs), tapered)
        link.offer = self._offer(connection, spec, pairs, codec)
        offer = link.offer is not None
        inline = [] if offer else self._inline_chunks(t, plan, pairs, codec, self._inline_count(plan, pairs, codec))
        wire_start = time.perf_counter()
        # The first streamed chunk of GPU memory is encoded on the GPU while its announce is written.
        first = None
        if not offer and len(inline) < len(plan) and pairs[0].region.tensor.is_cuda:
            pair_index, start, count = plan[len(inline)]
            first = asyncio.ensure_future(self._encode_chunk(t, codec, pairs[pair_index], start, count, len(inline)))
        try:
            await connection.send_message(self._announce(t, spec, pairs, book, len(inline), offer,
                                                         peer.FLAG_TAPERED if tapered else 0), *inline)
        except BaseException:
            _drop(first)
            raise
        t.mark("announced")
        if inline:
            t.mark("first_byte")
        if offer:
            accept = await self._accepted(link)
            if accept.targets:
                if len(accept.targets) != len(pairs):
                    raise ProtocolViolation(f"{len(accept.targets)} targets for {len(pairs)} region pairs")
                helds = self._leases(connection, spec, pairs, candidates) or [
                    Held(dst, target, p.region.block_shape, p.region.dtype)
                    for (_, dst), p, target in zip(spec.pairs, pairs, accept.targets)]  # lost already: this once
                await self._write_same_host(t, spec, pairs, helds)
                return
        if len(inline) < len(plan):
            await self._stream(t, connection, link, plan, pairs, codec, len(inline), first)
        t.mark("last_byte")
        wire_s = time.perf_counter() - wire_start
        self.engine.metrics.wire_seconds.inc(wire_s)
        self.engine.policy.observe_link(t.peer, t.bytes_wire, wire_s)
        self.engine.policy.observe_ratio(t.chosen_codec, t.bytes_raw, t.bytes_wire)
        # Done only when the receiver has written every block.
        done = await self._reply(link, self.engine.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.engine.finish(t, State.DONE)
        self.engine.policy.observe_transfer(t.peer, t.chosen_codec, _measured_bytes(spec, pairs),
                                            time.perf_counter() - t.submitted)

    @staticmethod
    def _inline_count(plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec) -> int:
        """How many leading chunks of ``plan`` may ride inline (host memory, each and all small)."""
        total = 0
        for index, (pair_index, _, blocks) in enumerate(plan):
            region = pairs[pair_index].region
            size = codec.capacity((blocks, *region.block_shape), region.tensor.dtype)
            total += size
            if region.tensor.is_cuda or size > peer.INLINE_CHUNK_BYTES or total > peer.INLINE_TOTAL_BYTES:
                return index
        return len(plan)

    def _inline_chunks(self, t: Transfer, plan: list[tuple[int, int, int]], pairs: list[Pair],
                       codec: codecs.Codec, count: int) -> list[bytes]:
        """The first ``count`` chunks (small, of host memory: see ``_inline_count``), encoded on
        the event loop as CHUNK messages for the announce's write."""
        inline = []
        for index, (pair_index, start, blocks) in enumerate(plan[:count]):
            pair = pairs[pair_index]
            nbytes = blocks * pair.region.block_bytes
            frame = self.engine.codec.encode_now(codec, pair.region.tensor, pair.ids[start:start + blocks], pair.bound,
                                                 nbytes)
            frame = self._account_chunk(t, frame, nbytes, index)
            inline.append(peer.pack(peer.Message(t.id, peer.Chunk(index, memoryview(frame.numpy())))))
        return inline

    async def _stream(self, t: Transfer, connection: transport.Connection, link: PeerLink,
                      plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec, inline: int,
                      first: asyncio.Future | None = None) -> None:
        """The chunks after the inline ones, as transport transfers: each sent as soon as it is
        encoded, the next encoded while earlier ones are on the wire, at most
        ``max_inflight_chunks`` encoded and unacknowledged. ``first``: the first one's encode,
        begun already."""
        slots = asyncio.Semaphore(self.engine.settings.max_inflight_chunks)
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
                    payload = await self._encode_chunk(t, codec, pairs[pair_index], start, count, index)
                self.engine.metrics.inflight_chunks.inc()
                eager = index < inline + peer.EAGER_CHUNKS
                sends.append(asyncio.create_task(self._send_chunk(connection, t, index, payload, slots, eager)))
                # Let the send start (its checksum launched, its first message written) before the
                # next chunk's encode takes the GPU: the first chunk reaches the link sooner.
                await asyncio.sleep(0)
            await self._first(link, asyncio.gather(*sends))
        finally:
            _drop(first)
            for task in sends:
                task.cancel()

    async def _accepted(self, link: PeerLink) -> peer.Accept:
        """The receiver's ACCEPT (or its refusal, raised)."""
        timeout = self.engine.settings.transfer_timeout
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
        WRITTEN after an ACCEPT, or (``leased``: under a standing lease) the announce itself."""
        link = self.engine.links[t.id]
        raw = _raw_bytes(spec, pairs)
        self._same_host(t)
        announce = self._announce(t, spec, pairs, None, 0, True, peer.FLAG_WRITTEN) if leased else None
        device = pairs[0].region.tensor.device
        try:
            with self.engine.leases.writing(link.connection, helds):
                await self.engine.codec.call("encode", device, raw, functools.partial(self._write_blocks, spec, pairs, helds))
        except (RuntimeError, EngineError) as exc:
            raise PeerError(f"cannot write into the receiver's memory: {exc}") from exc
        t.bytes_raw = raw
        t.mark("first_byte")
        t.mark("last_byte")
        if announce is not None:
            await link.connection.send_message(announce)
            t.mark("announced")
        else:
            await link.connection.send_message(peer.pack(peer.Message(t.id, peer.Written(len(spec.dst_blocks)))))
        done = await self._reply(link, self.engine.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.engine.finish(t, State.DONE)

    @staticmethod
    def _same_host(t: Transfer) -> None:
        t.chosen_codec = next(c.name for c in codecs.lossless() if getattr(c, "identity", False))
        t.choice_reason = "same host: written straight into the receiver's memory (CUDA IPC or shared memory)"
        t.lossy = False

    def _write_blocks(self, spec: TransferSpec, pairs: list[Pair], helds: list[Held]) -> None:
        """The gather-scatter of every pair's blocks into the receiver's memory (one kernel each on
        a GPU); a few blocks are copied one by one, which costs fewer driver calls than building
        index tensors; spreads go as their ids, which the kernel spreads (listing 16,384 ids of
        each side and copying them to the GPU took ~0.3 ms on an H100 host)."""
        resolved: dict[int, Ids] = {}
        few = (spec.src_blocks.listed is not None and spec.dst_blocks.listed is not None
               and len(spec.src_blocks) <= FEW_BLOCKS)
        for pair, held in zip(pairs, helds):
            region, target = pair.region, held.target
            remote = self.engine.mapper.tensor(target, (target.num_blocks, *region.block_shape), region.tensor.dtype,
                                               region.tensor.device)
            if target.num_blocks not in resolved:  # checked on the host
                resolved[target.num_blocks] = Ids.of(spec.dst_blocks, target.num_blocks)
            if few:
                blockcopy.copy_listed(region.tensor, spec.src_blocks.listed, remote, spec.dst_blocks.listed)
                continue
            src, dst = pair.index.spread, resolved[target.num_blocks].spread
            if src is not None and dst is not None and src[1] == dst[1]:
                ids = torch.tensor(src[0] + dst[0], dtype=torch.int64).to(region.tensor.device)  # one small copy
                blockcopy.copy_spread(region.tensor, ids[:len(src[0])], remote, ids[len(src[0]):], src[1], src[2], dst[2])
                continue
            src_ids, dst_ids = pair.index.with_(resolved[target.num_blocks], region.tensor.device)
            blockcopy.copy_blocks(region.tensor, src_ids, remote, dst_ids)

    async def _encode_chunk(self, t: Transfer, codec: codecs.Codec, pair: Pair, start: int, count: int,
                            index: int) -> torch.Tensor:
        nbytes = count * pair.region.block_bytes
        payload = await self.engine.codec.encode(codec, pair.region.tensor, pair.ids[start:start + count], pair.bound,
                                                 nbytes)
        return self._account_chunk(t, payload, nbytes, index)

    def _account_chunk(self, t: Transfer, payload: torch.Tensor, nbytes: int, index: int) -> torch.Tensor:
        if index == self.engine.settings.fault_corrupt_chunk:
            payload = payload.clone()
            payload[20] ^= 0xFF  # inside a frame's header: the receiver must reject it
        t.bytes_raw += nbytes
        t.bytes_wire += payload.numel()
        self.engine.metrics.chunks.labels("out").inc()
        return payload

    async def _first(self, link: PeerLink, work: asyncio.Future) -> None:
        """Await ``work``, but stop at once with the peer's refusal if that comes first."""
        await asyncio.wait({work, link.reply}, return_when=asyncio.FIRST_COMPLETED)
        if link.reply.done() and link.reply.exception() is not None:
            work.cancel()  # the peer's own word says more than a chunk it refused
            raise link.reply.exception()
        # DONE can be read before the sends wake up to their acknowledgements, which precede it.
        await work

    async def _reply(self, link: PeerLink, timeout: float) -> peer.Done:
        if not link.reply.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(link.reply)
            except TimeoutError:
                if not link.reply.done():
                    raise PeerError(f"the receiver did not confirm within {timeout:g} s") from None
        return link.reply.result()

    async def _send_chunk(self, connection: transport.Connection, t: Transfer, index: int, payload: torch.Tensor,
                          slots: asyncio.Semaphore, eager: bool) -> None:
        try:
            t.mark("first_byte")
            await connection.send(peer.chunk_tag(t.id, index), payload, eager=eager)
        except transport.TransportError as exc:
            raise PeerError(f"chunk {index}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.engine.metrics.inflight_chunks.dec()
            slots.release()


def _drop(work: asyncio.Future | None) -> None:
    """Cancel ``work`` if it is still running, and take any error it ended with (reported otherwise)."""
    if work is None:
        return
    if work.done():
        if not work.cancelled():
            work.exception()
    else:
        work.cancel()


def _failed(exc: Exception) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


def _destinations(spec: TransferSpec, pairs: list[Pair]) -> tuple[list[str], list[tuple[int, ...]], str]:
    """(destination region names, block shapes, dtype): what a lease must match."""
    return [dst for _, dst in spec.pairs], [p.region.block_shape for p in pairs], pairs[0].region.dtype


def _measured_bytes(spec: TransferSpec, pairs: list[Pair]) -> int:
    """The bytes a transfer's time is a speed of for ``auto`` (``Policy.observe_transfer``): none
    where a codebook is used for the first time (``Pair.fresh_book``)."""
    return 0 if any(p.fresh_book for p in pairs) else _raw_bytes(spec, pairs)


def _raw_bytes(spec: TransferSpec, pairs: list[Pair]) -> int:
    """The KV bytes a transfer moves: its blocks of every region pair."""
    return len(spec.src_blocks) * sum(p.region.block_bytes for p in pairs)
