"""The sending side of one transfer: choose the codec, announce, stream the chunks (small ones
inline behind the announce, the rest as transport transfers, encoded while earlier ones are on the
wire) or write them straight into a receiver's lent GPU memory, and wait for the receiver's DONE."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvferry import codec as codecs, transport

from . import ipc, peer
from .errors import EngineError, PeerError, ProtocolViolation
from .links import Pair, PeerLink, describe
from .transfers import State, Transfer

if TYPE_CHECKING:
    from .engine import Engine, TransferSpec

log = logging.getLogger("kvferry.engine")


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
            state, kind, reason = self.engine.aborted(t)
            self.engine.finish(t, state, kind, reason)
            self.engine.tell(t, peer.Cancel(reason))
        except Exception as exc:
            kind, reason = describe(exc)
            log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self.engine.finish(t, State.FAILED, kind, reason)
            self.engine.tell(t, peer.Cancel(f"{kind}: {reason}"))
        finally:
            self.engine.unlink(t)

    async def _send(self, t: Transfer, spec: TransferSpec, pairs: list[Pair], candidates: list[str],
                    book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        t.move(State.RUNNING)
        raw_bytes = len(spec.src_blocks) * sum(p.region.block_bytes for p in pairs)
        if len(candidates) == 1:
            chosen, t.choice_reason = candidates[0], "requested"
        else:
            chosen, t.choice_reason = self.engine.policy.choose(t.peer, raw_bytes, self.engine.chunk_bytes, candidates)
        t.chosen_codec = chosen
        codec = codecs.get(chosen)
        if book is not None and book[0] != chosen:
            book = None
        codebook = book[1] if book is not None else None
        try:
            connection = await self.engine.pool.get(*address)
        except transport.TransportError as exc:
            raise PeerError(f"cannot reach {t.peer}: {type(exc).__name__}: {exc}") from exc
        link = self.engine.link(t, PeerLink(connection))
        plan = peer.plan_chunks(len(spec.src_blocks), tuple(p.blocks_per_chunk for p in pairs))
        # GPU blocks may be written straight into a receiver on this host (it says in its ACCEPT),
        # unless a transfer asked for a codec that changes the bytes.
        offer = (ipc.available() and all(p.region.tensor.is_cuda for p in pairs)
                 and (spec.codec == "auto" or getattr(codec, "identity", False)))
        inline = [] if offer else await self._inline_chunks(t, plan, pairs, codec, codebook)
        announce = peer.Announce(
            codec=chosen, dtype=pairs[0].region.dtype, dst_blocks=spec.dst_blocks,
            pairs=tuple(peer.PairLayout(dst, p.region.block_shape, p.blocks_per_chunk)
                        for (_, dst), p in zip(spec.pairs, pairs)),
            codebook=spec.codebook or "", codebook_digest=peer.codebook_digest(book[2]) if book else bytes(8),
            inline_chunks=len(inline), host=ipc.host_id() if offer else bytes(16))
        wire_start = time.perf_counter()
        await connection.send_message(peer.pack(peer.Message(t.id, announce)), *inline)
        t.mark("announced")
        if inline:
            t.mark("first_byte")
        if offer:
            accept = await self._accepted(link)
            if accept.targets:
                await self._write_same_host(t, spec, pairs, accept.targets)
                return
        await self._stream(t, connection, link, plan, pairs, codec, codebook, len(inline))
        wire_s = time.perf_counter() - wire_start
        self.engine.metrics.wire_seconds.inc(wire_s)
        self.engine.policy.observe_link(t.peer, t.bytes_wire, wire_s)
        self.engine.policy.observe_ratio(chosen, t.bytes_raw, t.bytes_wire)
        # Done only when the receiver has written every block.
        done = await self._reply(link, self.engine.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.engine.finish(t, State.DONE)
        self.engine.policy.observe_transfer(t.peer, chosen, raw_bytes, time.perf_counter() - t.submitted)

    async def _inline_chunks(self, t: Transfer, plan: list[tuple[int, int, int]], pairs: list[Pair],
                             codec: codecs.Codec, codebook: Any) -> list[bytes]:
        """The leading small chunks of host memory, encoded as CHUNK messages for the announce's write."""
        inline, total = [], 0
        for index, (pair_index, start, count) in enumerate(plan):
            region = pairs[pair_index].region
            size = codec.capacity((count, *region.block_shape), region.tensor.dtype)
            if region.tensor.is_cuda or size > peer.INLINE_CHUNK_BYTES or total + size > peer.INLINE_TOTAL_BYTES:
                break
            frame = await self._encode_chunk(t, codec, pairs[pair_index], start, count, codebook, index)
            inline.append(peer.pack(peer.Message(t.id, peer.Chunk(index, frame.numpy().tobytes()))))
            total += size
        return inline

    async def _stream(self, t: Transfer, connection: transport.Connection, link: PeerLink,
                      plan: list[tuple[int, int, int]], pairs: list[Pair], codec: codecs.Codec, codebook: Any,
                      inline: int) -> None:
        """The chunks after the inline ones, as transport transfers: encoded while earlier ones
        are on the wire, at most ``max_inflight_chunks`` encoded and unacknowledged."""
        slots = asyncio.Semaphore(self.engine.settings.max_inflight_chunks)
        sends: list[asyncio.Task] = []
        try:
            for index, (pair_index, start, count) in enumerate(plan):
                if index < inline:
                    continue
                await slots.acquire()
                if link.reply.done() or any(task.done() and task.exception() for task in sends):
                    break
                payload = await self._encode_chunk(t, codec, pairs[pair_index], start, count, codebook, index)
                self.engine.metrics.inflight_chunks.inc()
                eager = index < inline + peer.EAGER_CHUNKS
                sends.append(asyncio.create_task(self._send_chunk(connection, t, index, payload, slots, eager)))
            await self._first(link, asyncio.gather(*sends))
        finally:
            for task in sends:
                task.cancel()
        t.mark("last_byte")

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

    async def _write_same_host(self, t: Transfer, spec: TransferSpec, pairs: list[Pair],
                               targets: tuple[peer.Target, ...]) -> None:
        """Write the blocks into the receiver's lent GPU memory, then tell it (WRITTEN) and wait
        for its DONE."""
        if len(targets) != len(pairs):
            raise ProtocolViolation(f"{len(targets)} targets for {len(pairs)} region pairs")
        link = self.engine.links[t.id]
        identity = next(c.name for c in codecs.lossless() if getattr(c, "identity", False))
        t.chosen_codec = identity
        t.choice_reason = "same host: written straight into the receiver's GPU memory (CUDA IPC)"
        raw = len(spec.src_blocks) * sum(p.region.block_bytes for p in pairs)

        def write() -> None:
            resolved: dict[tuple[int, str], torch.Tensor] = {}
            for pair, target in zip(pairs, targets):
                region = pair.region
                remote = self.engine.mapper.tensor(target, (target.num_blocks, *region.block_shape), region.tensor.dtype)
                key = (target.num_blocks, str(remote.device))
                if key not in resolved:
                    resolved[key] = spec.dst_blocks.resolve(target.num_blocks, remote.device)
                bits = codecs.layout_by_name(region.dtype).int_dtype
                blocks = region.tensor.view(bits).index_select(0, pair.ids).to(remote.device, non_blocking=True)
                remote.view(bits).index_copy_(0, resolved[key], blocks)

        try:
            await self.engine.codec.call("encode", pairs[0].region.tensor.device, raw, write)
        except (RuntimeError, EngineError) as exc:
            raise PeerError(f"cannot write into the receiver's GPU memory: {exc}") from exc
        t.bytes_raw = raw
        t.mark("first_byte")
        t.mark("last_byte")
        await link.connection.send_message(peer.pack(peer.Message(t.id, peer.Written(len(spec.dst_blocks)))))
        done = await self._reply(link, self.engine.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self.engine.finish(t, State.DONE)

    async def _encode_chunk(self, t: Transfer, codec: codecs.Codec, pair: Pair, start: int, count: int,
                            codebook: Any, index: int) -> torch.Tensor:
        nbytes = count * pair.region.block_bytes
        payload = await self.engine.codec.encode(codec, pair.region.tensor, pair.ids[start:start + count], codebook, nbytes)
        if index == self.engine.settings.fault_corrupt_chunk:
            payload = payload.clone()
            payload[20] ^= 0xFF  # inside a frame's header: the receiver must reject it
        t.bytes_raw += nbytes
        t.bytes_wire += payload.numel()
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
