"""The receiving side: admitting an announced transfer (validated once: regions, blocks, codec;
receives posted before the next message is read, or GPU memory lent to a sender on this host),
then taking its chunks in order and decoding each straight into the destination blocks."""

from __future__ import annotations

import asyncio
import logging

import torch

from kvferry import codec as codecs, transport

from . import ipc, peer
from .blocks import Ids
from .codebooks import codec_named
from .context import TransferContext
from .errors import BadRequest, Conflict, CorruptChunk, EngineError, PeerError, ProtocolViolation, UnknownCodec
from .links import Pair, PeerLink, describe
from .regions import DTYPES
from .settings import Settings
from .states import Event, On
from .transfers import Transfer, peer_source

log = logging.getLogger("kvferry.engine")


class Admission:
    """Admits announced transfers, with the services of ``ctx``."""

    def __init__(self, ctx: TransferContext):
        self.ctx = ctx

    def accept(self, connection: transport.Connection, transfer_id: str, announce: peer.Announce) -> None:
        """Validate an announced transfer and post its first receives, or refuse it. Its sizes
        and counts are checked before anything is planned or allocated, and the plan and tags
        are arithmetic: an announce costs no more than its bytes."""
        try:
            self._check_sizes(announce)
            lent = bool(announce.flags & (peer.FLAG_WRITTEN | peer.FLAG_WRITING))
            if lent:
                self._check_lease(connection, announce)
            t, pairs, codec = self._check(connection, transfer_id, announce, decodes=not lent)
        except EngineError as exc:
            kind, reason = describe(exc)
            self.ctx.metrics.errors.labels(kind).inc()
            # Chunks the sender may send before it reads the refusal are refused too; it stops at the REJECT.
            first = min(announce.inline_chunks, peer.MAX_INLINE_CHUNKS)
            self.ctx.plane.listener.mailbox.refuse(peer.ChunkTags(transfer_id, first + peer.EAGER_CHUNKS)[first:],
                                                   f"{kind}: {reason}")
            connection.post_message(peer.pack(peer.Message(transfer_id, peer.Reject(kind, reason))))
            return
        try:
            self._admit(connection, t, pairs, codec, announce)
        except Exception as exc:  # recorded already: whatever fails now ends it, told to the sender
            log.exception("admitting transfer %s failed", t.id)
            if self.ctx.links.get(t.id) is None:
                self.ctx.links.add(t, PeerLink(connection))
            self.ctx.driver.apply(t, Event(On.FAIL, "EngineError", f"admission failed: {type(exc).__name__}: {exc}"))

    def _admit(self, connection: transport.Connection, t: Transfer, pairs: list[Pair], codec: codecs.Codec,
               announce: peer.Announce) -> None:
        """The admitted transfer started: done at once where it was written, else its plan, its
        receives or its lease, and its task."""
        apply = self.ctx.driver.apply
        if announce.flags & peer.FLAG_WRITTEN:  # nothing to come: no plan
            self._written(connection, t, pairs)
            return
        plan = peer.plan_chunks(len(announce.dst_blocks), tuple(p.blocks_per_chunk for p in announce.pairs),
                                bool(announce.flags & peer.FLAG_TAPERED))
        tags = peer.ChunkTags(t.id, len(plan))
        if announce.flags & peer.FLAG_WRITING:  # being written: done once the sender's event is reached
            end = self.ctx.events.open(announce.event, announce.event_gpu,
                                       ipc.event_device(pairs[0].region.tensor.device), connection)
            incoming = Incoming(self.ctx, connection, t, pairs, plan, tags, codec, lent=True, end=end)
            self.ctx.links.add(t, PeerLink(connection, incoming=incoming))
            apply(t, Event(On.ADMIT_LENT))
            # In place already (the copy may have finished before its announce was read): done at once.
            if end is not None and _reached(end):
                incoming.all_written()
                self.ctx.links.drop(t)
                return
            if end is None:  # its event does not open here: the sender's WRITTEN says when
                connection.post_message(peer.pack(peer.Message(t.id, peer.Accept())))
            t.task = asyncio.create_task(incoming.run())
            return
        targets = self._lend(connection, announce, pairs)
        # Targets lent behind inline chunks are a lease for later transfers; this one rides inline.
        writes_itself = bool(targets) and not announce.inline_chunks
        incoming = Incoming(self.ctx, connection, t, pairs, plan, tags, codec, announce.inline_chunks, writes_itself)
        self.ctx.links.add(t, PeerLink(connection, incoming=incoming))
        apply(t, Event(On.ADMIT_LENT if writes_itself else On.ADMIT))
        if incoming.now:  # decoded as its chunks are read, right behind this announce
            if announce.host != bytes(16):  # the answer to an offer (a lease, or none), before the DONE
                connection.post_message(peer.pack(peer.Message(t.id, peer.Accept(targets))))
            timeout = self.ctx.settings.transfer_timeout
            t.deadline = asyncio.get_running_loop().call_later(
                timeout, apply, t, Event(On.DEADLINE, "PeerError", f"inline chunks did not come within {timeout:g} s"))
            return
        if not writes_itself:
            try:
                incoming.post_ahead()
            except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                apply(t, Event(On.FAIL, "InsufficientStorage", f"cannot allocate its receive buffers: {reason}"))
                return
        if targets or announce.host != bytes(16) or announce.inline_chunks < len(plan):
            connection.post_message(peer.pack(peer.Message(t.id, peer.Accept(targets))))
        t.task = asyncio.create_task(incoming.run())

    def _written(self, connection: transport.Connection, t: Transfer, pairs: list[Pair]) -> None:
        """A transfer the sender wrote under its standing lease before it announced it: done here
        and now, in one move from queued that tells the sender (DONE) on the announce's
        connection. Nothing of it is to come, so no pipeline is built."""
        _count_written(t, pairs)
        self.ctx.links.add(t, PeerLink(connection))
        self.ctx.driver.apply(t, Event(On.PEER_WRITTEN))

    def _check_sizes(self, a: peer.Announce) -> None:
        """Counts checked by arithmetic before any work: blocks, chunks, inline chunks.

        Raises: BadRequest, ProtocolViolation.
        """
        blocks, limit = len(a.dst_blocks), self.ctx.settings.max_blocks_per_transfer
        if blocks > limit:
            raise BadRequest(f"a transfer of {blocks} blocks is over this sidecar's {limit} (max_blocks_per_transfer)")
        chunks = peer.chunk_count(blocks, tuple(p.blocks_per_chunk for p in a.pairs))
        if chunks > peer.MAX_CHUNKS:
            raise BadRequest(f"a transfer of {chunks} chunks is over {peer.MAX_CHUNKS}")
        if a.inline_chunks > min(peer.MAX_INLINE_CHUNKS, chunks + 2):  # + 2: a tapered plan's extra chunks
            raise ProtocolViolation(f"{a.inline_chunks} inline chunks announced for {chunks} chunks")
        if a.inline_chunks:
            self._check_inline(a)

    @staticmethod
    def _check_inline(a: peer.Announce) -> None:
        """Inline chunks are decoded on the event loop as they are read: each is held to the size
        a sender inlines (``streaming.inline_count``), by the same arithmetic.

        Raises: BadRequest, UnknownCodec, ProtocolViolation.
        """
        codec, dtype = codec_named(a.codec), DTYPES.get(a.dtype)
        if dtype is None:
            raise BadRequest(f"unknown dtype {a.dtype!r}")
        if not codec.supports(dtype):
            raise BadRequest(f"codec {a.codec!r} does not code {a.dtype}")
        plan = peer.plan_chunks(len(a.dst_blocks), tuple(p.blocks_per_chunk for p in a.pairs),
                                bool(a.flags & peer.FLAG_TAPERED))
        announced = min(a.inline_chunks, len(plan))
        fits = peer.inline_prefix(codec.capacity((plan[i][2], *a.pairs[plan[i][0]].block_shape), dtype)
                                  for i in range(announced))
        if fits < announced:
            raise ProtocolViolation(f"inline chunk {fits} is over what rides inline: {peer.INLINE_CHUNK_BYTES} "
                                    f"bytes a chunk, {peer.INLINE_TOTAL_BYTES} in all")

    def _check_lease(self, connection: transport.Connection, a: peer.Announce) -> None:
        """A transfer written before (or while) it is announced must be raw, whole, into regions
        lent to this connection (and not taken back since: one being taken back, its REVOKED not yet
        come, is still lent, and ``_check`` refuses the transfer as the region's delete's).

        Raises: ProtocolViolation.
        """
        codec = codec_named(a.codec)
        if not codec.capabilities.identity or a.inline_chunks:
            raise ProtocolViolation(f"a transfer written under a lease is raw and carries no chunks, not {a.codec!r}")
        leases = self.ctx.leases
        for layout in a.pairs:
            if not (leases.lent_to(layout.dst_region, connection) or leases.revoking(layout.dst_region, connection)):
                raise ProtocolViolation(f"written under a lease of region {layout.dst_region!r} this connection "
                                        "does not hold")

    def _lend(self, connection: transport.Connection, announce: peer.Announce,
              pairs: list[Pair]) -> tuple[peer.Target, ...]:
        """Targets for a sender on this host that offered to write our regions itself: CUDA IPC
        handles of GPU regions, or the names of host shared-memory regions. They stand as a lease
        of this connection (``leases.py``)."""
        if announce.host != ipc.host_id() or any(p.region.closing for p in pairs):
            return ()
        on_gpu = [p.region.tensor.is_cuda for p in pairs]
        targets = []
        try:
            for p in pairs:
                region = p.region
                if all(on_gpu) and ipc.available():
                    if region.ipc_export is None:  # owned GPU memory: exported once, lent on
                        handle, offset, _ = ipc.export(region.tensor)
                        region.ipc_export = (handle, offset)
                    handle, offset = region.ipc_export
                    targets.append(peer.Target(handle, offset, ipc.device_uuid(region.tensor.device.index),
                                               region.num_blocks))
                elif not any(on_gpu) and region.kind == "shm" and len(region.shm_name) <= peer.HANDLE_BYTES:
                    segment = region.named_segment()
                    if segment is None:
                        log.info("streaming instead of lending region %r: its shared memory's name %r no longer "
                                 "names it", region.name, region.shm_name)
                        return ()
                    targets.append(peer.Target(region.shm_name.encode().ljust(peer.HANDLE_BYTES, b"\0"), 0,
                                               peer.HOST_MEMORY, region.num_blocks, peer.segment_id(segment)))
                else:
                    return ()
        except RuntimeError as exc:
            log.info("streaming instead of lending GPU memory: %s", exc)
            return ()
        for p in pairs:
            self.ctx.leases.lend(p.region.name, connection)
        return tuple(targets)

    def _check(self, connection: transport.Connection, transfer_id: str, a: peer.Announce, decodes: bool = True):
        """The transfer recorded, with its pairs and codec, once the announce is found valid here
        (``decodes``: its chunks are decoded here, not written by the sender, so the codec is bound)."""
        codec = codec_named(a.codec)
        book = None
        if a.codebook:
            entry = self.ctx.codebooks.get(a.codebook)
            if entry is not None and peer.codebook_digest(entry[2]) == a.codebook_digest:
                book = entry[1]
            elif codec.capabilities.decode_needs_codebook:
                raise UnknownCodec(f"no codebook {a.codebook!r} with the sender's digest here")
        elif codec.capabilities.decode_needs_codebook:
            raise UnknownCodec(f"codec {a.codec!r} needs a codebook and the sender named none")
        pairs, cache = [], {}
        for layout in a.pairs:
            region = self.ctx.regions.get(layout.dst_region)
            if region.quarantined:
                raise Conflict(f"region {region.name!r} is quarantined: {region.quarantined}")
            if region.closing:  # nothing lands in memory its owner is letting go, nor holds its delete up
                raise Conflict(f"region {region.name!r} is being deleted")
            if region.dtype != a.dtype or region.block_shape != layout.block_shape:
                raise BadRequest(f"region {region.name!r} holds {region.dtype}{list(region.block_shape)} blocks, "
                                 f"the transfer carries {a.dtype}{list(layout.block_shape)}")
            if not codec.supports(region.tensor.dtype):  # its capacity and decode would raise later
                raise BadRequest(f"codec {a.codec!r} does not code region {region.name!r}'s {region.dtype}")
            chunk = min(layout.blocks_per_chunk, len(a.dst_blocks)) * region.block_bytes
            if chunk > max(peer.MAX_CHUNK_BYTES, region.block_bytes):  # what its receive buffers would take
                raise BadRequest(f"chunks of {chunk} bytes are over the protocol's {peer.MAX_CHUNK_BYTES}")
            # Checked on the host; blocks written before their announce are never indexed here.
            key = region.num_blocks
            if key not in cache:
                cache[key] = Ids.of(a.dst_blocks, region.num_blocks)
            reference = (self.ctx.reference_for(region, layout.reference, a.dst_blocks, cache)
                         if layout.reference else None)
            pairs.append(Pair(region, cache[key], layout.blocks_per_chunk, reference))
        if decodes:
            self.ctx.bind(codec, book, pairs, sending=False)  # frames carry what decoding needs
        t = Transfer(id=transfer_id, direction="in", peer=connection.peer,
                     source=peer_source(connection.peer, connection.id), pairs=[("", p.dst_region) for p in a.pairs], blocks=len(a.dst_blocks), codec=a.codec,
                     chosen_codec=a.codec, choice_reason="the sender's", lossy=not codec.lossless,
                     references=[p.reference.name for p in pairs if p.reference is not None])
        self.ctx.transfers.add(t)
        for p in pairs:
            p.region.busy.add(t.id)
            if p.reference is not None:
                p.reference.busy.add(t.id)
        return t, pairs, codec



class Incoming:
    """The receiving side of one transfer: chunks decoded in order, each into a buffer granted
    ahead on the announce's connection (a credit: the sender sends nothing else)."""

    def __init__(self, ctx: TransferContext, connection: transport.Connection, t: Transfer, pairs: list[Pair],
                 plan: peer.Plan, tags: peer.ChunkTags, codec: codecs.Codec, inline_chunks: int = 0,
                 lent: bool = False, end: ipc.WriteEnd | None = None):
        """``lent``: the sender writes the blocks itself, and its WRITTEN says when it is finished,
        or, given, the sender's event ``end`` is reached."""
        self.ctx, self.connection, self.t, self.pairs, self.plan, self.tags = ctx, connection, t, pairs, plan, tags
        t.cleanups.append(self.release)
        self.codec = codec
        loop = asyncio.get_running_loop()
        self.written: asyncio.Future | None = loop.create_future() if lent else None
        self.end = end
        self.inline: dict[int, asyncio.Future] = {i: loop.create_future() for i in range(min(inline_chunks, len(plan)))}
        self.receives: dict[int, transport.Receive] = {}
        self.ahead = credit_ahead(ctx.settings)
        self.completed = 0
        # Every chunk inline and small, into host memory: each is decoded as the reader hands it
        # over (no task, no thread hop), and the last one's DONE goes out at once.
        self.now = (not lent and len(self.inline) == len(plan)
                    and not any(p.region.tensor.is_cuda for p in pairs))

    def written_by_peer(self, written: peer.Written) -> bool:
        """The sender's WRITTEN; False where none is expected (only its event says so, or it came
        already) or it counts other blocks."""
        if self.written is None or self.end is not None or self.written.done() or written.blocks != self.t.blocks:
            return False
        self.written.set_result(written.blocks)
        return True

    async def _lent(self, timeout: float) -> None:
        """The sender writes our lent memory itself: wait for its WRITTEN, or its event."""
        try:
            if self.end is not None:
                await transport.until_ready(self.end, timeout=timeout, what="the sender's write")
            else:
                async with asyncio.timeout(timeout):
                    await self.written
        except (TimeoutError, transport.TransportTimeout):
            raise PeerError(f"the sender did not write within {timeout:g} s") from None
        except RuntimeError as exc:  # the driver's word on the sender's event
            raise PeerError(f"the sender's write failed: {exc}") from None
        self._count_written()

    def _count_written(self) -> None:
        _count_written(self.t, self.pairs)
        self.completed = len(self.plan)

    def all_written(self) -> None:
        """Every block is in place already (the sender's event was reached before its announce
        was read): done."""
        self._count_written()
        self._done(written=True)

    def arrived(self, chunk: peer.Chunk) -> bool:
        """An inline chunk came; False if none such was announced (or it came twice). The
        futures stay in ``inline`` for the transfer's life: their keys say which chunks ride inline."""
        future = self.inline.get(chunk.index)
        if future is None or future.done():
            return False
        if not self.now:
            future.set_result(chunk.frame)
            return True
        if chunk.index != self.completed or self.t.state.terminal:
            return False  # they are written in order on one connection
        future.set_result(None)
        try:
            self._decode(chunk.index, _frame(chunk.frame), len(chunk.frame))
        except Exception as exc:
            self._failed(exc)
            return True
        if self.completed == len(self.plan):
            self._done()
        return True

    def _decode(self, i: int, frame: torch.Tensor, nbytes: int) -> None:
        """Chunk ``i`` into its blocks (on this thread: ``now`` chunks are small)."""
        pair_index, start, count = self.plan[i]
        pair, t = self.pairs[pair_index], self.t
        if i == 0:
            t.mark("first_byte")
        raw = count * pair.region.block_bytes
        try:
            self.ctx.codec.decode_now(self.codec, frame, pair.region.tensor, pair.ids[start:start + count],
                                      pair.bound, raw)
        except codecs.CodecError as exc:
            raise CorruptChunk(f"chunk {i}: {type(exc).__name__}: {exc}") from exc
        self._count(nbytes, raw, count)

    def _count(self, nbytes: int, raw: int, blocks: int) -> None:
        t = self.t
        t.bytes_wire += nbytes
        t.bytes_raw += raw
        t.blocks_done += blocks
        self.completed += 1
        self.ctx.metrics.chunks.labels("in").inc()
        if self.completed < len(self.plan):
            self.ctx.driver.apply(t, Event(On.CHUNK))

    def _done(self, written: bool = False) -> None:
        """Every block is written (``written``: by the sender, into lent memory): done here, and
        the sender is told at once (DONE)."""
        self.t.mark("last_byte")
        self.ctx.driver.apply(self.t, Event(On.PEER_WRITTEN if written else On.LAST_CHUNK))

    def _failed(self, exc: Exception) -> None:
        kind, reason = describe(exc)
        if not self.t.state.terminal:
            self.ctx.log_peer_failure(f"incoming transfer {self.t.id} failed: {kind}: {reason}")
        self.ctx.driver.apply(self.t, Event(On.FAIL, kind, reason))

    def release(self) -> None:
        """What this transfer holds, let go however it ended: posted receives (their buffers back
        to the pool once nothing can land in them) and the tags of chunks still on their way."""
        for receive in self.receives.values():
            receive.cancel()
        self.receives.clear()
        if self.completed < len(self.plan):  # chunks granted and still on their way are refused by name
            end = min(len(self.plan), self.completed + len(self.inline) + self.ahead)
            self.ctx.plane.listener.mailbox.refuse(self.tags[self.completed:end],
                                                   f"transfer {self.t.id} ended {self.t.state.value}")

    async def _next_frame(self, i: int, timeout: float) -> tuple[torch.Tensor, int]:
        if i in self.inline:
            try:
                async with asyncio.timeout(timeout):
                    data = await self.inline[i]
            except TimeoutError:
                raise PeerError(f"inline chunk {i} did not come within {timeout:g} s") from None
            frame = _frame(data)
            region = self.pairs[self.plan[i][0]].region
            return (frame.to(region.tensor.device) if region.tensor.is_cuda else frame), len(data)
        # It fails once its connection lands nothing for ``timeout`` (the transport's watch), or
        # delivers under the floor on average past it: a peer that drips a byte now and then cannot
        # hold it open, while a chunk waiting its turn behind others' on a busy connection waits.
        nbytes = await self.receives[i].wait(timeout, self.ctx.settings.min_peer_bytes_per_s)
        return self.receives[i].buffer.obj[:nbytes], nbytes

    def post(self, i: int) -> None:
        """Grant chunk ``i`` a buffer: the first ``EAGER_CHUNKS`` after the inline ones silently
        (the initial credit, which the sender uses without waiting), the others by a CTS."""
        if i < len(self.plan) and i not in self.receives and i not in self.inline:
            pair_index, _, count = self.plan[i]
            region = self.pairs[pair_index].region
            capacity = self.codec.capacity((count, *region.block_shape), region.tensor.dtype)
            buffer = self.ctx.buffers.take(capacity, region.tensor.device)
            self.receives[i] = self.connection.grant(self.tags[i], buffer, defer_check=True,
                                                     tell=i >= len(self.inline) + peer.EAGER_CHUNKS)

    def post_ahead(self) -> None:
        """Buffers for the first transport chunks, granted before the next message is read."""
        first = len(self.inline)
        for i in range(first, first + self.ahead):
            self.post(i)

    async def run(self) -> None:
        ctx, t = self.ctx, self.t
        timeout = ctx.settings.transfer_timeout
        try:
            if self.written is not None:
                await self._lent(timeout)
            for i, (pair_index, start, count) in enumerate(self.plan if self.written is None else ()):
                frame, nbytes = await self._next_frame(i, timeout)
                self.post(i + self.ahead)
                pair = self.pairs[pair_index]
                raw = count * pair.region.block_bytes
                if i == 0:
                    t.mark("first_byte")
                receive = self.receives.get(i)
                try:
                    await ctx.codec.decode(self.codec, frame, pair.region.tensor, pair.ids[start:start + count],
                                           pair.bound, raw, check=receive.start_check if receive else None)
                except codecs.CodecError as exc:
                    raise CorruptChunk(f"chunk {i}: {type(exc).__name__}: {exc}") from exc
                if i in self.receives:
                    ctx.buffers.give(self.receives.pop(i).buffer.obj)
                self._count(nbytes, raw, count)
            self._done(written=self.written is not None)
        except asyncio.CancelledError:
            ctx.driver.apply(t, Event(On.CANCEL, "Cancelled", "cancelled"))  # ended already, unless by the loop
        except Exception as exc:
            self._failed(exc)
        finally:
            ctx.links.drop(t)


def _count_written(t: Transfer, pairs: list[Pair]) -> None:
    """Every block of ``t`` written by its sender into lent memory."""
    t.mark("last_byte")
    t.blocks_done = t.blocks * len(pairs)
    t.bytes_raw = sum(t.blocks * p.region.block_bytes for p in pairs)


def _reached(end: ipc.WriteEnd) -> bool:
    """Whether the sender's event is reached already; a failed one is left to the wait, which
    fails the transfer with the driver's word."""
    try:
        return end.ready()
    except RuntimeError:
        return False


def credit_ahead(settings: Settings) -> int:
    """How many chunks past the last one taken a receiver grants buffers for: the sender's
    ``max_inflight_chunks`` and one more, within the protocol's ``CREDIT_WINDOW``."""
    return min(max(settings.max_inflight_chunks + 1, peer.EAGER_CHUNKS), peer.CREDIT_WINDOW)


def _frame(data: bytes | memoryview) -> torch.Tensor:
    """An inline chunk's frame as a tensor, without a copy where the bytes are writable."""
    writable = isinstance(data, memoryview) and not data.readonly
    return torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)
