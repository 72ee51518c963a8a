"""The typed core of a sidecar: regions, codebooks, transfers and the peer protocol.

Sending: the sender announces a transfer on its (pooled, authenticated) data connection to the
peer, then streams chunks right behind the announce: blocks grouped into chunks of about
``chunk_bytes``, each encoded while earlier ones are on the wire, at most ``max_inflight_chunks``
encoded and unacknowledged. The receiver validates the announce once, posts receives for the next
chunks (so bytes land only where a chunk is expected), decodes each one straight into the
destination blocks, and answers DONE once every block is written; only then is the sender done.
Every message between the two is a peer message (``peer.py``) on that same connection: sidecars
never call each other over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry import __version__, codec as codecs, transport

from . import ipc, peer
from .blocks import Blocks
from .errors import (BadRequest, Conflict, EngineError, NotFound, PeerError, ProtocolViolation, TransferFailed,
                     UnknownCodec)
from .metrics import Metrics
from .pipeline import BufferPool, CodecRunner
from .policy import Policy
from .regions import Region, RegionSpec, RegionTable
from .settings import Settings
from .transfers import State, Transfer, TransferTable

log = logging.getLogger("kvferry.engine")
# A GPU chunk pays ~0.2-0.3 ms of host work per codec call and ~1 ms per message over UCX
# (measured on H200s), so GPU chunks are large; on the CPU the codec is slow enough that small
# chunks keep the pipeline short.
GPU_CHUNK_BYTES = 256 << 20
CPU_CHUNK_BYTES = 4 << 20
CPU_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class TransferSpec:
    """One transfer: the same blocks of every (source, destination) region pair, to ``peer``
    (the receiving sidecar's data address, ``host:port``)."""

    peer: str
    pairs: tuple[tuple[str, str], ...]
    src_blocks: Blocks
    dst_blocks: Blocks
    codec: str = "auto"
    codebook: str | None = None


@dataclass
class _Pair:
    """A validated region pair with its block ids resolved once (the hot path only slices them)."""

    region: Region
    ids: torch.Tensor
    blocks_per_chunk: int


@dataclass
class _Link:
    """The peer-protocol side of a transfer: its connection, and what the peer said last."""

    connection: transport.Connection
    reply: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    incoming: _Incoming | None = None  # the receiving side's pipeline


class Engine:
    """Everything one sidecar holds; started and closed by its front end (the REST app's lifespan)."""

    def __init__(self, settings: Settings):
        settings.check()
        self.settings = settings
        if settings.cpu_threads > 0:
            # On a small host, idle OpenMP workers spinning after each op starve the event loop and
            # the peer process: latency-bound deployments pin this low.
            torch.set_num_threads(settings.cpu_threads)
        wanted = settings.device
        if wanted.startswith("cuda"):
            self.device = torch.device(wanted)
        else:
            self.device = torch.device("cuda" if wanted == "auto" and torch.cuda.is_available() else "cpu")
        self.regions = RegionTable(self.device, settings.max_region_bytes, settings.shm_prefix)
        self.transfers = TransferTable(settings.max_concurrent_transfers)
        self.metrics = Metrics()
        self.codebooks: dict[str, tuple[str, Any, str]] = {}  # name -> (codec, codebook, its JSON)
        # An emulated link's speed is known; otherwise assume one until measured.
        self.policy = Policy(assumed_link_gbps=settings.link_gbps or settings.assumed_link_gbps)
        self.chunk_bytes = settings.chunk_bytes or (GPU_CHUNK_BYTES if self.device.type == "cuda" else CPU_CHUNK_BYTES)
        self.codec = CodecRunner(self.device, self.policy,
                                 lambda direction, s: self.metrics.codec_seconds.labels(direction).inc(s))
        # On a GPU each message costs a UCX rendezvous and Python work, so a frame travels whole;
        # host memory moves in 16 MiB pieces.
        message_bytes = settings.transport_chunk_bytes or (
            self.chunk_bytes + (1 << 20) if self.device.type == "cuda" else CPU_MESSAGE_BYTES)
        self.transport_config = transport.TransportConfig(
            backend=settings.transport_backend, chunk_bytes=message_bytes,
            max_inflight_bytes=max(settings.transport_window_bytes, settings.max_inflight_chunks * message_bytes),
            op_timeout=settings.transfer_timeout, pace_bytes_per_s=settings.link_gbps * 1e9,
            secret=settings.peer_secret.encode(), max_connections=settings.max_connections,
            idle_timeout=settings.idle_timeout,
            ucx_options={**transport.DEFAULT_UCX_OPTIONS, **settings.ucx_options})
        self.backend = transport.resolve_backend(self.transport_config)
        self.listener: transport.Listener | None = None
        self.pool: transport.Pool | None = None
        self.buffers = BufferPool(4 * settings.max_inflight_chunks * self.chunk_bytes + (64 << 20))
        self._links: dict[str, _Link] = {}  # transfer id -> its peer link, while it runs
        self._mapper = ipc.Mapper()  # receivers' GPU memory lent to us, opened once
        self.ready = False

    # ---- lifetime ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.listener = await transport.listen(self.settings.data_host, self.settings.data_port,
                                               self.transport_config, backend=self.backend,
                                               on_message=self._on_message)
        self.pool = transport.Pool(self.transport_config, backend=self.backend, on_message=self._on_message)
        self.metrics.info.info({"version": __version__, "transport_backend": self.backend, "device": str(self.device),
                                "codecs": ",".join(codecs.names())})
        sample = min(self.chunk_bytes, 16 << 20 if self.device.type == "cuda" else 1 << 20)
        await asyncio.to_thread(self.codec.measure, codecs.lossless(), self.device, sample)
        self.ready = True
        log.info("data plane: %s listener on %s:%d; codecs on %s: %s", self.backend, self.settings.data_host,
                 self.listener.port, self.device, self.policy.codecs)

    @property
    def data_address(self) -> str:
        """How peers reach this sidecar's data listener (``host:port``)."""
        host = self.settings.advertise_host or self.settings.data_host
        return f"{host}:{self.listener.port if self.listener else self.settings.data_port}"

    async def close(self) -> None:
        """Stop taking work, end what is in flight (telling the peers), release the data plane."""
        self.ready = False
        for t in self.transfers.active():
            self._abort(t, State.CANCELLED, "Shutdown", "the sidecar shut down")
        tasks = [t.task for t in self.transfers.all() if t.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let the control loops write the last CANCELs
        if self.pool is not None:
            await self.pool.close()
        if self.listener is not None:
            await self.listener.close()
        self._mapper.close()
        self.regions.close()
        transport.shutdown_backends()

    # ---- regions and codebooks ----------------------------------------------------------------
    async def register_region(self, spec: RegionSpec) -> Region:
        """Register memory; a large allocation runs off the event loop.

        Raises: Conflict, BadRequest, PayloadTooLarge (over ``max_region_bytes``).
        """
        return self.regions.add(await asyncio.to_thread(self.regions.prepare, spec))

    def delete_region(self, name: str) -> None:
        """Raises: NotFound, Conflict (a transfer uses it)."""
        self.regions.delete(name)

    def write_block(self, name: str, index: int, data: bytes) -> None:
        """Overwrite one block with its raw bytes. Raises: NotFound, InvalidBlocks, BadRequest, Conflict."""
        region = self.regions.get(name)
        ids = region.resolve([index])
        if len(data) != region.block_bytes:
            raise BadRequest(f"block {index} of {name!r} is {region.block_bytes} bytes, got {len(data)}")
        if region.busy:
            raise Conflict(f"region {name!r} is in use by a transfer")
        bits = codecs.layout_by_name(region.dtype).int_dtype
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(bits).view(region.block_shape)
        region.tensor.view(bits)[int(ids[0])].copy_(block)

    def read_block(self, name: str, index: int) -> bytes:
        """One block's raw bytes. Raises: NotFound, InvalidBlocks."""
        region = self.regions.get(name)
        region.resolve([index])
        return region.tensor[index].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()

    def put_codebook(self, name: str, codec_name: str, text: str | bytes) -> dict[str, Any]:
        """Store a codebook document for ``codec_name``. Raises: UnknownCodec, BadRequest."""
        codec = self._codec(codec_name)
        try:
            book = codec.codebook_from_json(text)
        except (codecs.CodecError, ValueError, TypeError, RecursionError, OverflowError) as exc:
            raise BadRequest(f"not a {codec_name} codebook: {type(exc).__name__}: {exc}") from None
        return self._keep_codebook(name, codec, book)

    def calibrate_codebook(self, name: str, codec_name: str, region_name: str, blocks: Blocks | list[int],
                           token_axis: int | None = None) -> dict[str, Any]:
        """Calibrate a codebook on blocks of a region and store it. Raises: NotFound, UnknownCodec, BadRequest."""
        codec = self._codec(codec_name)
        region = self.regions.get(region_name)
        ids = region.resolve(blocks)
        bits = codecs.layout_by_name(region.dtype).int_dtype  # index_select lacks some float8 kernels
        sample = region.tensor.view(bits).index_select(0, ids).view(region.tensor.dtype)
        try:
            book = codec.calibrate(sample, token_axis=None if token_axis is None else token_axis + 1)
        except codecs.CodecError as exc:
            raise BadRequest(f"cannot calibrate {codec_name}: {exc}") from exc
        return self._keep_codebook(name, codec, book)

    def codebook_json(self, name: str) -> str:
        """Raises: NotFound."""
        if name not in self.codebooks:
            raise NotFound(f"no codebook named {name!r}")
        return self.codebooks[name][2]

    def _keep_codebook(self, name: str, codec: codecs.Codec, book: Any) -> dict[str, Any]:
        text = book.to_json()
        self.codebooks[name] = (codec.name, book, text)
        return {"name": name, "codec": codec.name, "digest": peer.codebook_digest(text).hex()}

    def _codec(self, name: str) -> codecs.Codec:
        try:
            return codecs.get(name)
        except codecs.UnknownCodec as exc:
            raise UnknownCodec(str(exc)) from None

    # ---- sending ------------------------------------------------------------------------------
    def submit(self, spec: TransferSpec) -> Transfer:
        """Validate an outgoing transfer once and start it; returns at once.

        Raises:
            NotFound, InvalidBlocks, BadRequest, UnknownCodec, Overloaded.
        """
        host, port = _address(spec.peer)
        if not spec.pairs:
            raise BadRequest("a transfer needs at least one region pair")
        if len(spec.src_blocks) != len(spec.dst_blocks):
            raise BadRequest(f"{len(spec.src_blocks)} source blocks but {len(spec.dst_blocks)} destination blocks")
        pairs, cache = [], {}
        for src, _ in spec.pairs:
            region = self.regions.get(src)
            key = (region.num_blocks, str(region.tensor.device))
            if key not in cache:
                cache[key] = region.resolve(spec.src_blocks)
            per_chunk = max(1, self.chunk_bytes // region.block_bytes)
            pairs.append(_Pair(region, cache[key], per_chunk))
        if len(spec.dst_blocks) > peer.MAX_IDS:
            raise BadRequest(f"over {peer.MAX_IDS} blocks")
        dtypes = {p.region.dtype for p in pairs}
        if len(dtypes) != 1:
            raise BadRequest(f"the source regions mix dtypes {sorted(dtypes)}")
        candidates = self._candidates(spec.codec, pairs[0].region.tensor.dtype)
        book = self._named_codebook(spec.codebook, candidates)
        transfer = Transfer(id=uuid.uuid4().hex, direction="out", peer=spec.peer, pairs=list(spec.pairs),
                            blocks=len(spec.src_blocks), codec=spec.codec)
        self.transfers.add(transfer)
        for p in pairs:
            p.region.busy.add(transfer.id)  # a shm/IPC mapping must outlive the reads of this transfer
        transfer.task = asyncio.create_task(self._run_outgoing(transfer, spec, pairs, candidates, book, (host, port)))
        return transfer

    def _candidates(self, requested: str, dtype: torch.dtype) -> list[str]:
        if requested == "auto":
            names = [c.name for c in codecs.lossless() if c.supports(dtype) and c.name in self.policy.codecs]
            if not names:
                raise UnknownCodec("no lossless codec handles this dtype")
            return names
        codec = self._codec(requested)
        if not codec.supports(dtype):
            raise UnknownCodec(f"codec {requested!r} does not handle {dtype}")
        return [requested]

    def _named_codebook(self, name: str | None, candidates: list[str]) -> tuple[str, Any, str] | None:
        """The named codebook; it is used if the chosen codec is the one it is for (a transfer
        that ends up raw needs none)."""
        if name is None:
            return None  # each chunk calibrates on itself where the codec needs a codebook
        if name not in self.codebooks:
            raise NotFound(f"no codebook named {name!r}")
        return self.codebooks[name]

    async def _run_outgoing(self, t: Transfer, spec: TransferSpec, pairs: list[_Pair], candidates: list[str],
                            book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        try:
            await self._send(t, spec, pairs, candidates, book, address)
        except asyncio.CancelledError:
            state, kind, reason = self._aborted(t)
            self._finish(t, state, kind, reason)
            self._tell(t, peer.Cancel(reason))
        except Exception as exc:
            kind, reason = _describe(exc)
            log.warning("transfer %s failed: %s: %s", t.id, kind, reason)
            self._finish(t, State.FAILED, kind, reason)
            self._tell(t, peer.Cancel(f"{kind}: {reason}"))
        finally:
            self._links.pop(t.id, None)

    async def _send(self, t: Transfer, spec: TransferSpec, pairs: list[_Pair], candidates: list[str],
                    book: tuple[str, Any, str] | None, address: tuple[str, int]) -> None:
        t.move(State.RUNNING)
        raw_bytes = len(spec.src_blocks) * sum(p.region.block_bytes for p in pairs)
        if len(candidates) == 1:
            chosen, t.choice_reason = candidates[0], "requested"
        else:
            chosen, t.choice_reason = self.policy.choose(t.peer, raw_bytes, self.chunk_bytes, candidates)
        t.chosen_codec = chosen
        codec = codecs.get(chosen)
        if book is not None and book[0] != chosen:
            book = None
        codebook = book[1] if book is not None else None
        try:
            connection = await self.pool.get(*address)
        except transport.TransportError as exc:
            raise PeerError(f"cannot reach {t.peer}: {type(exc).__name__}: {exc}") from exc
        link = self._links[t.id] = _Link(connection)
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
        self.metrics.wire_seconds.inc(wire_s)
        self.policy.observe_link(t.peer, t.bytes_wire, wire_s)
        self.policy.observe_ratio(chosen, t.bytes_raw, t.bytes_wire)
        # Done only when the receiver has written every block.
        done = await self._reply(link, self.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self._finish(t, State.DONE)
        self.policy.observe_transfer(t.peer, chosen, raw_bytes, time.perf_counter() - t.submitted)

    async def _inline_chunks(self, t: Transfer, plan: list[tuple[int, int, int]], pairs: list[_Pair],
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

    async def _stream(self, t: Transfer, connection: transport.Connection, link: _Link,
                      plan: list[tuple[int, int, int]], pairs: list[_Pair], codec: codecs.Codec, codebook: Any,
                      inline: int) -> None:
        """The chunks after the inline ones, as transport transfers: encoded while earlier ones
        are on the wire, at most ``max_inflight_chunks`` encoded and unacknowledged."""
        slots = asyncio.Semaphore(self.settings.max_inflight_chunks)
        sends: list[asyncio.Task] = []
        try:
            for index, (pair_index, start, count) in enumerate(plan):
                if index < inline:
                    continue
                await slots.acquire()
                if link.reply.done() or any(task.done() and task.exception() for task in sends):
                    break
                payload = await self._encode_chunk(t, codec, pairs[pair_index], start, count, codebook, index)
                self.metrics.inflight_chunks.inc()
                eager = index < inline + peer.EAGER_CHUNKS
                sends.append(asyncio.create_task(self._send_chunk(connection, t, index, payload, slots, eager)))
            await self._first(link, asyncio.gather(*sends))
        finally:
            for task in sends:
                task.cancel()
        t.mark("last_byte")

    async def _accepted(self, link: _Link) -> peer.Accept:
        """The receiver's ACCEPT (or its refusal, raised)."""
        timeout = self.settings.transfer_timeout
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

    async def _write_same_host(self, t: Transfer, spec: TransferSpec, pairs: list[_Pair],
                               targets: tuple[peer.Target, ...]) -> None:
        """Write the blocks into the receiver's lent GPU memory, then tell it (WRITTEN) and wait
        for its DONE."""
        if len(targets) != len(pairs):
            raise ProtocolViolation(f"{len(targets)} targets for {len(pairs)} region pairs")
        link = self._links[t.id]
        identity = next(c.name for c in codecs.lossless() if getattr(c, "identity", False))
        t.chosen_codec = identity
        t.choice_reason = "same host: written straight into the receiver's GPU memory (CUDA IPC)"
        raw = len(spec.src_blocks) * sum(p.region.block_bytes for p in pairs)

        def write() -> None:
            resolved: dict[tuple[int, str], torch.Tensor] = {}
            for pair, target in zip(pairs, targets):
                region = pair.region
                remote = self._mapper.tensor(target, (target.num_blocks, *region.block_shape), region.tensor.dtype)
                key = (target.num_blocks, str(remote.device))
                if key not in resolved:
                    resolved[key] = spec.dst_blocks.resolve(target.num_blocks, remote.device)
                bits = codecs.layout_by_name(region.dtype).int_dtype
                blocks = region.tensor.view(bits).index_select(0, pair.ids).to(remote.device, non_blocking=True)
                remote.view(bits).index_copy_(0, resolved[key], blocks)

        try:
            await self.codec.call("encode", pairs[0].region.tensor.device, raw, write)
        except (RuntimeError, EngineError) as exc:
            raise PeerError(f"cannot write into the receiver's GPU memory: {exc}") from exc
        t.bytes_raw = raw
        t.mark("first_byte")
        t.mark("last_byte")
        await link.connection.send_message(peer.pack(peer.Message(t.id, peer.Written(len(spec.dst_blocks)))))
        done = await self._reply(link, self.settings.transfer_timeout)
        t.blocks_done = done.blocks
        self._finish(t, State.DONE)

    async def _encode_chunk(self, t: Transfer, codec: codecs.Codec, pair: _Pair, start: int, count: int,
                            codebook: Any, index: int) -> torch.Tensor:
        nbytes = count * pair.region.block_bytes
        payload = await self.codec.encode(codec, pair.region.tensor, pair.ids[start:start + count], codebook, nbytes)
        if index == self.settings.fault_corrupt_chunk:
            payload = payload.clone()
            payload[20] ^= 0xFF  # inside a frame's header: the receiver must reject it
        t.bytes_raw += nbytes
        t.bytes_wire += payload.numel()
        return payload

    async def _first(self, link: _Link, work: asyncio.Future) -> None:
        """Await ``work``, but stop at once with the peer's refusal if that comes first."""
        await asyncio.wait({work, link.reply}, return_when=asyncio.FIRST_COMPLETED)
        if link.reply.done() and link.reply.exception() is not None:
            work.cancel()  # the peer's own word says more than a chunk it refused
            raise link.reply.exception()
        # DONE can be read before the sends wake up to their acknowledgements, which precede it.
        await work

    async def _reply(self, link: _Link, timeout: float) -> peer.Done:
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
            self.metrics.inflight_chunks.dec()
            slots.release()

    # ---- receiving ----------------------------------------------------------------------------
    def _on_message(self, connection: transport.Connection, payload: bytes) -> None:
        """A peer message (called from the connection's reader, so never awaits)."""
        try:
            message = peer.unpack(payload)
        except ProtocolViolation as exc:
            log.warning("dropped a malformed peer message from %s: %s", connection.peer, exc)
            self.metrics.errors.labels("ProtocolViolation").inc()
            return
        body = message.body
        if isinstance(body, peer.Announce):
            self._accept(connection, message.transfer_id, body)
            return
        link = self._links.get(message.transfer_id)
        if link is None or link.connection is not connection:
            return  # finished already, or not this peer's to speak for: nothing to do
        t = self.transfers.find(message.transfer_id)
        if isinstance(body, peer.Chunk):
            if link.incoming is None or not link.incoming.arrived(body):
                self._abort_protocol(t, connection, f"unexpected inline chunk {body.index}")
        elif isinstance(body, peer.Cancel):
            if t is not None:
                self._abort(t, State.CANCELLED, "Cancelled", f"cancelled by the peer: {body.reason}")
        elif isinstance(body, peer.Accept):
            if t is not None:
                t.mark("accepted")
            if not link.accepted.done():
                link.accepted.set_result(body)
        elif isinstance(body, peer.Written):
            if link.incoming is None or not link.incoming.written_by_peer(body):
                self._abort_protocol(t, connection, "WRITTEN for a transfer that lent no memory")
        elif not link.reply.done():
            if isinstance(body, peer.Done):
                link.reply.set_result(body)
            else:  # Reject or Error
                verb = "refused" if isinstance(body, peer.Reject) else "failed"
                link.reply.set_exception(PeerError(f"the receiver {verb} the transfer: {body.error}: {body.reason}"))
                link.reply.exception()

    def _accept(self, connection: transport.Connection, transfer_id: str, announce: peer.Announce) -> None:
        """Validate an announced transfer and post its first receives, or refuse it."""
        plan = peer.plan_chunks(len(announce.dst_blocks), tuple(p.blocks_per_chunk for p in announce.pairs))
        tags = [peer.chunk_tag(transfer_id, i) for i in range(len(plan))]
        try:
            t, pairs, codec, book = self._check_announce(connection, transfer_id, announce)
        except EngineError as exc:
            kind, reason = _describe(exc)
            self.metrics.errors.labels(kind).inc()
            self.listener.mailbox.refuse(tags, f"{kind}: {reason}")
            connection.post_message(peer.pack(peer.Message(transfer_id, peer.Reject(kind, reason))))
            return
        targets = self._lend(announce, pairs)
        incoming = _Incoming(self, t, pairs, plan, tags, codec, book, announce.inline_chunks, bool(targets))
        link = self._links[t.id] = _Link(connection, incoming=incoming)
        connection.on_close(lambda c, exc: self._lost(t, link, exc))
        t.move(State.RUNNING)
        if not targets:
            incoming.post_ahead()
        if targets or announce.host != bytes(16) or announce.inline_chunks < len(plan):
            connection.post_message(peer.pack(peer.Message(t.id, peer.Accept(targets))))
        t.task = asyncio.create_task(incoming.run())

    def _lend(self, announce: peer.Announce, pairs: list[_Pair]) -> tuple[peer.Target, ...]:
        """IPC targets for a sender on this host that offered to write our GPU regions itself."""
        if announce.host != ipc.host_id() or not ipc.available():
            return ()
        if not all(p.region.tensor.is_cuda for p in pairs):
            return ()
        targets = []
        try:
            for p in pairs:
                region = p.region
                if region.ipc_export is None:  # owned GPU memory: exported once, lent on
                    handle, offset, _ = ipc.export(region.tensor)
                    region.ipc_export = (handle, offset)
                handle, offset = region.ipc_export
                targets.append(peer.Target(handle, offset, ipc.device_uuid(region.tensor.device.index),
                                           region.num_blocks))
        except RuntimeError as exc:
            log.info("streaming instead of lending GPU memory: %s", exc)
            return ()
        return tuple(targets)

    def _abort_protocol(self, t: Transfer | None, connection: transport.Connection, reason: str) -> None:
        self.metrics.errors.labels("ProtocolViolation").inc()
        log.warning("peer %s broke the protocol: %s", connection.peer, reason)
        if t is not None and not t.state.terminal:
            self._abort(t, State.FAILED, "ProtocolViolation", reason)

    def _check_announce(self, connection: transport.Connection, transfer_id: str, a: peer.Announce):
        codec = self._codec(a.codec)
        book = None
        if a.codebook:
            entry = self.codebooks.get(a.codebook)
            if entry is not None and peer.codebook_digest(entry[2]) == a.codebook_digest:
                book = entry[1]
            elif getattr(codec, "decode_needs_codebook", False):
                raise UnknownCodec(f"no codebook {a.codebook!r} with the sender's digest here")
        pairs, cache = [], {}
        for layout in a.pairs:
            region = self.regions.get(layout.dst_region)
            if region.dtype != a.dtype or region.block_shape != layout.block_shape:
                raise BadRequest(f"region {region.name!r} holds {region.dtype}{list(region.block_shape)} blocks, "
                                 f"the transfer carries {a.dtype}{list(layout.block_shape)}")
            key = (region.num_blocks, str(region.tensor.device))
            if key not in cache:
                cache[key] = region.resolve(a.dst_blocks)
            pairs.append(_Pair(region, cache[key], layout.blocks_per_chunk))
        t = Transfer(id=transfer_id, direction="in", peer=connection.peer,
                     pairs=[("", p.dst_region) for p in a.pairs], blocks=len(a.dst_blocks), codec=a.codec,
                     chosen_codec=a.codec, choice_reason="the sender's")
        self.transfers.add(t)
        for p in pairs:
            p.region.busy.add(t.id)
        return t, pairs, codec, book

    def _lost(self, t: Transfer, link: _Link, exc: Exception) -> None:
        if not t.state.terminal:
            self._abort(t, State.FAILED, "PeerError", f"lost the peer: {type(exc).__name__}: {exc}")
        if not link.reply.done():
            link.reply.set_exception(PeerError(f"lost the peer: {type(exc).__name__}: {exc}"))
            link.reply.exception()  # retrieved: a receiver's link has nobody awaiting it

    # ---- waiting, cancelling, state -----------------------------------------------------------
    async def wait(self, transfer_id: str, timeout: float) -> dict[str, Any]:
        """The transfer's record once it is done.

        Raises:
            NotFound. TransferFailed: it failed or was cancelled (with the reason), or is still
            running after ``timeout`` seconds (state "running").
        """
        t = self.transfers.get(transfer_id)
        await t.wait(timeout)
        if t.state == State.DONE:
            return t.public()
        if t.state.terminal:
            raise TransferFailed(f"transfer {t.id} {t.state.value}: {t.error_kind}: {t.error}", t.state.value)
        raise TransferFailed(f"transfer {t.id} still {t.state.value} after {timeout:g} s", t.state.value)

    def status(self, transfer_id: str) -> dict[str, Any]:
        """Raises: NotFound."""
        return self.transfers.get(transfer_id).public()

    def cancel(self, transfer_id: str) -> dict[str, Any]:
        """Cancel a running transfer on either side; the peer is told. Raises: NotFound, Conflict."""
        t = self.transfers.get(transfer_id)
        if t.state.terminal:
            raise Conflict(f"transfer {transfer_id} is already {t.state.value}")
        self._abort(t, State.CANCELLED, "Cancelled", "cancelled by request")
        return t.public()

    def _abort(self, t: Transfer, state: State, kind: str, reason: str) -> None:
        """End ``t`` from outside its task: the task's cancellation handler finishes it as told."""
        if t.abort is None:
            t.abort = (state.value, kind, reason)
        if t.task is not None and not t.task.done():
            t.task.cancel()
        else:
            self._finish(t, state, kind, reason)

    def _aborted(self, t: Transfer) -> tuple[State, str, str]:
        state, kind, reason = t.abort or ("cancelled", "Cancelled", "cancelled")
        return State(state), kind, reason

    def _tell(self, t: Transfer, body: peer.Cancel | peer.Error | peer.Done) -> None:
        """Best effort: the peer learns why we stopped (it times out on its own otherwise)."""
        link = self._links.get(t.id)
        if link is not None and not link.connection.closed:
            link.connection.post_message(peer.pack(peer.Message(t.id, body)))

    def _finish(self, t: Transfer, state: State, kind: str | None = None, error: str | None = None) -> None:
        if t.move(state, error, kind):
            self._account(t)

    def _account(self, t: Transfer) -> None:
        """Bookkeeping once ``t`` is terminal: history, metrics, regions no longer busy."""
        state, kind = t.state, t.error_kind
        self.transfers.retire(t)
        self.metrics.finished(state.value, t.direction, t.bytes_raw, t.bytes_wire, t.seconds)
        if state == State.FAILED:
            self.metrics.errors.labels(kind or "EngineError").inc()
        for _, name in t.pairs if t.direction == "in" else [(None, s) for s, _ in t.pairs]:
            try:  # the region may be deleted again once no transfer uses it
                self.regions.get(name).busy.discard(t.id)
            except NotFound:
                pass

    def refresh_gauges(self) -> None:
        """Gauges that are cheaper to count at scrape time than to keep in step."""
        self.metrics.regions.set(len(self.regions))
        for direction in ("in", "out"):
            self.metrics.active.labels(direction).set(len(self.transfers.active(direction)))


class _Incoming:
    """The receiving side of one transfer: receives posted ahead, chunks decoded in order."""

    def __init__(self, engine: Engine, t: Transfer, pairs: list[_Pair], plan: list[tuple[int, int, int]],
                 tags: list[int], codec: codecs.Codec, book: Any, inline_chunks: int = 0, lent: bool = False):
        self.engine, self.t, self.pairs, self.plan, self.tags = engine, t, pairs, plan, tags
        self.codec, self.book = codec, book
        loop = asyncio.get_running_loop()
        self.written: asyncio.Future | None = loop.create_future() if lent else None
        self.inline: dict[int, asyncio.Future] = {i: loop.create_future() for i in range(min(inline_chunks, len(plan)))}
        self.receives: dict[int, transport.Receive] = {}
        self.ahead = max(engine.settings.max_inflight_chunks + 1, peer.EAGER_CHUNKS)
        self.completed = 0

    def written_by_peer(self, written: peer.Written) -> bool:
        if self.written is None or self.written.done() or written.blocks != self.t.blocks:
            return False
        self.written.set_result(written.blocks)
        return True

    async def _lent(self, timeout: float) -> None:
        """The sender writes our lent memory itself: wait for its WRITTEN."""
        try:
            async with asyncio.timeout(timeout):
                await self.written
        except TimeoutError:
            raise PeerError(f"the sender did not write within {timeout:g} s") from None
        self.t.mark("last_byte")
        self.t.blocks_done = self.t.blocks * len(self.pairs)
        self.t.bytes_raw = sum(self.t.blocks * p.region.block_bytes for p in self.pairs)
        self.completed = len(self.plan)

    def arrived(self, chunk: peer.Chunk) -> bool:
        """An inline chunk came; False if none such was announced (or it came twice). The
        futures stay in ``inline`` for the transfer's life: their keys say which chunks ride inline."""
        future = self.inline.get(chunk.index)
        if future is None or future.done():
            return False
        future.set_result(chunk.frame)
        return True

    async def _next_frame(self, i: int, timeout: float) -> tuple[torch.Tensor, int]:
        if i in self.inline:
            try:
                async with asyncio.timeout(timeout):
                    data = await self.inline[i]
            except TimeoutError:
                raise PeerError(f"inline chunk {i} did not come within {timeout:g} s") from None
            frame = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            region = self.pairs[self.plan[i][0]].region
            return (frame.to(region.tensor.device) if region.tensor.is_cuda else frame), len(data)
        # No progress for ``timeout`` fails it (the transport's watch), and so does a whole chunk
        # not arriving within ``timeout``: a peer that drips a byte now and then cannot hold it open.
        try:
            async with asyncio.timeout(timeout):
                nbytes = await self.receives[i].wait(timeout)
        except TimeoutError as exc:
            if isinstance(exc, transport.TransportError):
                raise
            raise PeerError(f"chunk {i} did not arrive within {timeout:g} s") from None
        return self.receives[i].buffer.obj[:nbytes], nbytes

    def post(self, i: int) -> None:
        if i < len(self.plan) and i not in self.receives and i not in self.inline:
            pair_index, _, count = self.plan[i]
            region = self.pairs[pair_index].region
            capacity = self.codec.capacity((count, *region.block_shape), region.tensor.dtype)
            buffer = self.engine.buffers.take(capacity, region.tensor.device)
            self.receives[i] = self.engine.listener.expect(self.tags[i], buffer)

    def post_ahead(self) -> None:
        """Receives for the first transport chunks, before the next message is read (the sender
        sends the first ``EAGER_CHUNKS`` of them without waiting)."""
        first = len(self.inline)
        for i in range(first, first + self.ahead):
            self.post(i)

    async def run(self) -> None:
        engine, t = self.engine, self.t
        timeout = engine.settings.transfer_timeout
        try:
            if self.written is not None:
                await self._lent(timeout)
            for i, (pair_index, start, count) in enumerate(self.plan if self.written is None else ()):
                frame, nbytes = await self._next_frame(i, timeout)
                if i == 0:
                    t.mark("first_byte")
                self.post(i + self.ahead)
                pair = self.pairs[pair_index]
                raw = count * pair.region.block_bytes
                try:
                    await engine.codec.decode(self.codec, frame, pair.region.tensor, pair.ids[start:start + count],
                                              self.book, raw)
                except codecs.CodecError as exc:
                    raise BadRequest(f"chunk {i}: {type(exc).__name__}: {exc}") from exc
                if i in self.receives:
                    engine.buffers.give(self.receives.pop(i).buffer.obj)
                t.bytes_wire += nbytes
                t.bytes_raw += raw
                t.blocks_done += count
                self.completed += 1
            t.mark("last_byte")
            if t.move(State.DONE):  # every block is written: done here, and say so at once
                try:
                    link = engine._links.get(t.id)
                    if link is not None:
                        with contextlib.suppress(transport.TransportError):
                            await link.connection.send_message(
                                peer.pack(peer.Message(t.id, peer.Done(t.blocks_done, t.bytes_raw, t.bytes_wire))))
                finally:
                    engine._account(t)
        except asyncio.CancelledError:
            state, kind, reason = engine._aborted(t)
            engine._finish(t, state, kind, reason)
            if kind != "PeerError":
                engine._tell(t, peer.Cancel(reason))
        except Exception as exc:
            kind, reason = _describe(exc)
            log.warning("incoming transfer %s failed: %s: %s", t.id, kind, reason)
            engine._finish(t, State.FAILED, kind, reason)
            engine._tell(t, peer.Error(kind, reason))
        finally:
            for receive in self.receives.values():
                receive.cancel()
            if self.completed < len(self.plan):  # chunks still on their way must not wait in the mailbox
                engine.listener.mailbox.refuse(self.tags[self.completed:], f"transfer {t.id} ended {t.state.value}")
            engine._links.pop(t.id, None)


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"peer must be the receiving sidecar's data address host:port, not {value!r}")
    return host, int(port)


def _describe(exc: BaseException) -> tuple[str, str]:
    """(error kind, reason): the kind is the class name, which metrics label and peers report."""
    return type(exc).__name__, str(exc)
