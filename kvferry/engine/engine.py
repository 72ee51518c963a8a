"""The typed core of a sidecar: regions, codebooks, transfers and their peer links. The rooms:
``outgoing.py`` sends, ``incoming.py`` admits and receives, ``dispatch.py`` acts on peer messages,
``codebooks.py`` keeps named codebooks and learns others, ``pipeline.py`` runs codec work,
``policy.py`` chooses codecs, ``peer.py`` owns the peer messages' bytes. The first three work
with ``context.py``'s ``TransferContext`` (the services they use), never with the engine.

A transfer's phases and the moves between them are ``states.py``'s, a table with no IO;
``driver.py`` applies them and is the one place a transfer ends.

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
import gc
import functools
import logging
import os
from typing import Any

import torch

from kvferry import __version__, codec as codecs, transport

from . import dispatch, ipc, peer, placement
from .blocks import Blocks, Ids
from .codebooks import Codebooks, Learner, codec_named
from .context import DataPlane, TransferContext
from .driver import Driver
from .errors import BadRequest, Conflict, NotFound, TransferFailed, UnknownCodec
from .incoming import Admission
from .leases import Leases
from .links import LinkTable, Pair, data_plane
from .metrics import Metrics
from .outgoing import Outgoing
from .pipeline import BufferPool, CodecRunner
from .policy import Policy
from .regions import Region, RegionSpec, RegionTable
from .settings import Settings
from .spin import MIN_CPUS, Mover, Spinner
from .transfers import State, Transfer, TransferSpec, TransferTable

log = logging.getLogger("kvferry.engine")
# A GPU chunk pays ~0.2-0.3 ms of host work per codec call and ~1 ms per message over UCX
# (measured on H200s), so GPU chunks are large; on the CPU the codec is slow enough that small
# chunks keep the pipeline short.
GPU_CHUNK_BYTES = 256 << 20
CPU_CHUNK_BYTES = 4 << 20
MAX_DRAIN_S = 300.0  # the longest a delete waits for the transfers that use its region


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
        self.transfers = TransferTable(settings.max_concurrent_transfers, max_incoming=settings.max_incoming_transfers,
                                       max_incoming_per_peer=settings.incoming_per_peer)
        self.metrics = Metrics()
        self.codebooks = Codebooks()
        self.learner = Learner()
        # An emulated link's speed is known; otherwise assume one until measured.
        self.policy = Policy(assumed_link_gbps=settings.emulated_link_gbps or settings.assumed_link_gbps)
        self.chunk_bytes = settings.chunk_bytes or (GPU_CHUNK_BYTES if self.device.type == "cuda" else CPU_CHUNK_BYTES)
        window, cpus = settings.spin_seconds(self.device.type), os.sched_getaffinity(0)
        mover = (Mover(cpus, on_move=self.metrics.loop_moves.inc)
                 if settings.loop_moves and window > 0 and len(cpus) >= MIN_CPUS else None)
        self.spinner = Spinner(window, self.metrics.spin_seconds.inc, mover)
        self.codec = CodecRunner(self.device, self.policy,
                                 lambda direction, s: self.metrics.codec_seconds.labels(direction).inc(s),
                                 self.spinner.in_thread, settings.transfer_timeout)
        self.transport_config, self.backend = data_plane(settings, self.device.type == "cuda", self.chunk_bytes)
        self.plane = DataPlane()  # the listener and the pool, once started
        self.buffers = BufferPool(4 * settings.max_inflight_chunks * self.chunk_bytes + (64 << 20))
        self.links = LinkTable(self._connection_lost)  # running transfers' peer links
        self.driver = Driver(self.transfers, self.links, self.metrics, self.regions)  # every change of phase
        # receivers' memory lent to us, opened once
        self.mapper = ipc.Mapper(settings.shm_prefix, self.regions.memories, lambda: self.regions.version,
                                 in_use=lambda: self.leases.in_use(), opened=self.metrics.peer_memory_opened.inc)
        self.metrics.peer_memory_mapped.set_function(self.mapper.mapped)
        self.leases = Leases(self.mapper.forget)  # standing leases of same-host memory, held and lent
        self.events = ipc.WriteEvents()  # the events of same-host writes announced while they run
        # What the sender, the receiver and the dispatch of peer messages work with: never this engine.
        self.ctx = TransferContext(
            settings=settings, chunk_bytes=self.chunk_bytes, plane=self.plane, driver=self.driver, links=self.links,
            transfers=self.transfers, regions=self.regions, codebooks=self.codebooks, learner=self.learner,
            policy=self.policy, codec=self.codec, buffers=self.buffers, leases=self.leases, mapper=self.mapper,
            events=self.events, metrics=self.metrics, spinner=self.spinner, peer_log=transport.RateLimitedLog(log))
        self.outgoing = Outgoing(self.ctx)
        self.admission = Admission(self.ctx)
        self.on_message = functools.partial(dispatch.on_message, self.ctx, self.admission)  # a peer message, from a reader
        self.ready = False

    @property
    def listener(self) -> transport.Listener | None:
        """The data listener, once started (held by ``plane``, which the context shares)."""
        return self.plane.listener

    @property
    def pool(self) -> transport.Pool | None:
        """The pool of connections to peers, once started (held by ``plane``)."""
        return self.plane.pool

    # ---- lifetime ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.spinner.start()
        self.plane.listener = await transport.listen(self.settings.data_host, self.settings.data_port,
                                                     self.transport_config, backend=self.backend,
                                                     on_message=self.on_message)
        self.plane.pool = transport.Pool(self.transport_config, backend=self.backend, on_message=self.on_message)
        # How the GPU is shared with the worker beside it: without MPS, each of this sidecar's
        # copies and kernels waits for the worker's time slice (docs/decisions/052-gpus-shared-under-mps.md).
        sharing = placement.gpu_sharing() if self.device.type == "cuda" else "none"
        self.metrics.info.info({"version": __version__, "transport_backend": self.backend, "device": str(self.device),
                                "codecs": ",".join(codecs.names()), "gpu_sharing": sharing})
        # Speeds per pipeline chunk, from samples of at most 64 MiB (1 MiB on a CPU) and a
        # quarter of that: a call's fixed cost and its cost per byte, extrapolated to the chunk.
        sample = min(self.chunk_bytes, 64 << 20 if self.device.type == "cuda" else 1 << 20)
        await self.spinner.in_thread(self.codec.measure, codecs.lossless(), self.device, sample, self.chunk_bytes)
        # What start-up built (torch, the codecs, the app: millions of objects that live as long as
        # the process) leaves the garbage collector's view: a full collection, which a peer's
        # message can trigger by allocating, then scans only what came later (~100 ms → ~1 ms).
        gc.collect()
        gc.freeze()
        if sharing == "time slices":
            log.warning("the GPU is shared by time slices (no CUDA MPS daemon found): this sidecar's copies and "
                        "kernels wait for the worker's turn on the GPU to end, ~1.8 ms beside a busy engine; "
                        "run both under MPS (docs/operations.md)")
        self.ready = True
        log.info("data plane: %s listener on %s:%d; codecs on %s: %s", self.backend, self.settings.data_host,
                 self.listener.port, self.device, self.policy.codecs)
        if self.spinner.mover is not None:
            log.info("event loop: busy-polls %g ms after activity, moving off CPUs that run it slowly (of %d)",
                     self.spinner.window * 1e3, len(self.spinner.mover.cpus))

    @property
    def data_address(self) -> str:
        """How peers reach this sidecar's data listener (``host:port``, an IPv6 host in brackets as
        in a URL, so that the port is never read as part of the address)."""
        host = self.settings.advertise_host or self.settings.data_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.listener.port if self.listener else self.settings.data_port}"

    async def close(self) -> None:
        """Stop taking work, end what is in flight (telling the peers), release the data plane."""
        self.ready = False
        for t in self.transfers.active():
            self.driver.cancel(t, "Shutdown", "the sidecar shut down")
        tasks = [t.task for t in self.transfers.all() if t.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let the control loops write the last CANCELs
        await self.learned()
        if self.pool is not None:
            await self.pool.close()
        if self.listener is not None:
            await self.listener.close()
        self.mapper.close()
        self.events.close()
        self.regions.close()
        await self.spinner.close()
        transport.shutdown_backends()

    # ---- regions and codebooks ----------------------------------------------------------------
    async def register_region(self, spec: RegionSpec) -> Region:
        """Register memory; a large allocation runs off the event loop.

        Raises: Conflict, BadRequest, PayloadTooLarge (over ``max_region_bytes``).
        """
        return self.regions.add(await self.spinner.in_thread(self.regions.prepare, spec))

    async def delete_region(self, name: str, force: bool = False, drain: float = 0.0) -> None:
        """Let a region go, once no peer may write into it under a standing lease. A sender that
        does not confirm the revocation in time may still be writing (stopped mid-write, say):
        the region is then quarantined, not deleted, so its memory is not reused under that
        write; ``force`` deletes a quarantined region (its owner knows the sender is gone).

        A transfer that has ended may still hold it while work it could not stop (a worker
        thread's codec call, GPU kernels) finishes; the delete waits for that, up to
        ``close_timeout``, so a delete right after a cancel is not refused.

        ``drain``: up to this many seconds for the transfers in progress that use it to end, new
        ones refused meanwhile (a worker shutting down under traffic); 0: refused at once while
        one is in progress. A region whose delete fails takes transfers again. Deletes of a region
        run one at a time, a later one once the one before has ended (it finds the region gone,
        or tries again): run side by side, one could free the memory while the other still
        waits for a sender to give its lease back.

        Raises: NotFound, Conflict (a transfer uses it, or a lease was not given back), BadRequest
        (``drain`` not within 0 to ``MAX_DRAIN_S``).
        """
        if not 0 <= drain <= MAX_DRAIN_S:
            raise BadRequest(f"drain is {drain!r} seconds: from 0 to {MAX_DRAIN_S:g}")
        region = self.regions.get(name)
        region.deleting += 1  # takes no new transfer, either way, while the running ones end
        try:
            async with region.deletes:
                if drain:
                    await self._drained(region, drain)
                await self._delete_region(name, region, force)
        finally:
            region.deleting -= 1

    async def _drained(self, region: Region, seconds: float) -> None:
        """Until no transfer in progress uses ``region``, at most ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (left := deadline - loop.time()) > 0:
            running = [t for t in map(self.transfers.find, list(region.busy)) if t is not None and not t.state.terminal]
            if not running:
                return
            await asyncio.gather(*(t.wait(left) for t in running))

    async def _delete_region(self, name: str, region: Region, force: bool) -> None:
        ended = await self._ended_work_over(region)
        if self.regions.get(name) is not region:  # deleted meanwhile, and maybe registered again
            raise NotFound(f"region {name!r} was deleted while this delete waited")
        if region.busy:
            why = (f" (ended; work they started did not finish within {self.transport_config.close_timeout:g} s)"
                   if ended else "")
            raise Conflict(f"region {name!r} is in use by transfers {sorted(region.busy)}{why}")
        if region.quarantined and not force:
            raise Conflict(f"region {name!r} is quarantined: {region.quarantined} (delete with force=true "
                           "once that sender is gone)")
        if views := self.regions.views(name):
            raise Conflict(f"region {name!r} has views {sorted(views)[:8]}: delete them first")
        silent = await self.leases.revoke(name, self.transport_config.close_timeout)
        timeout = self.transport_config.close_timeout
        for other in silent.regions:  # a sender stopped mid-write may be writing those as well
            held = self.regions.find(other)
            if held is not None and held.quarantined is None:
                held.quarantined = (f"{', '.join(silent.peers)} did not confirm giving back its lease of region "
                                    f"{name!r} within {timeout:g} s and may still write into this one, lent to it too")
        if silent.peers and not force:
            region.quarantined = (f"{', '.join(silent.peers)} did not confirm giving back its lease within "
                                  f"{timeout:g} s and may still write into it")
            raise Conflict(f"region {name!r} is quarantined, not deleted: {region.quarantined}")
        self.regions.delete(name)

    async def _ended_work_over(self, region: Region) -> bool:
        """Wait until no ended transfer holds ``region`` (its task is over), at most ``close_timeout``;
        False at once where a transfer in progress holds it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.transport_config.close_timeout
        while region.busy:
            pending = set()
            for transfer_id in region.busy:
                t = self.transfers.find(transfer_id)
                if t is None:  # ended long ago, its record forgotten
                    continue
                if not t.state.terminal:
                    return False
                if t.task is not None and not t.task.done():
                    pending.add(t.task)
            if not pending:
                await asyncio.sleep(0)  # a task just over: its done callback frees the region next
                return True
            left = deadline - loop.time()
            if left <= 0:
                return True
            await asyncio.wait(pending, timeout=left)
        return True

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
        return self.codebooks.put(name, codec_name, text)

    async def calibrate_codebook(self, name: str, codec_name: str, region_name: str, blocks: Blocks | list[int],
                                 token_axis: int | None = None, options: dict[str, Any] | None = None
                                 ) -> dict[str, Any]:
        """Calibrate a codebook on blocks of a region (the region's axis names and ``options`` go to
        the codec) and store it. Raises: NotFound, UnknownCodec, BadRequest."""
        region = self.regions.get(region_name)
        return await self.codebooks.calibrate(name, codec_name, region, blocks, token_axis, options)

    def codebook_json(self, name: str) -> str:
        """Raises: NotFound."""
        return self.codebooks.json(name)

    @staticmethod
    def codec_named(name: str) -> codecs.Codec:
        """Raises: UnknownCodec."""
        return codec_named(name)

    # ---- sending ------------------------------------------------------------------------------
    def submit(self, spec: TransferSpec) -> Transfer:
        """Validate an outgoing transfer once and start it; returns at once.

        Raises:
            NotFound, InvalidBlocks, BadRequest, UnknownCodec, Overloaded, Conflict (its id is taken).
        """
        host, port = _address(spec.peer)
        if not spec.pairs:
            raise BadRequest("a transfer needs at least one region pair")
        if len(spec.pairs) > peer.MAX_PAIRS:
            raise BadRequest(f"{len(spec.pairs)} region pairs is over {peer.MAX_PAIRS} per transfer")
        if len(spec.src_blocks) != len(spec.dst_blocks):
            raise BadRequest(f"{len(spec.src_blocks)} source blocks but {len(spec.dst_blocks)} destination blocks")
        pairs, cache = [], {}
        for src, _ in spec.pairs:
            region = self.regions.get(src)
            if region.deleting:  # a delete under way: nothing more is read from it
                raise Conflict(f"region {src!r} is being deleted")
            if region.num_blocks not in cache:  # checked on the host, copied to a GPU where needed
                cache[region.num_blocks] = Ids.of(spec.src_blocks, region.num_blocks)
            per_chunk = max(1, min(self.chunk_bytes, peer.MAX_CHUNK_BYTES) // region.block_bytes)
            pairs.append(Pair(region, cache[region.num_blocks], per_chunk))
        if len(spec.dst_blocks) > peer.MAX_IDS:
            raise BadRequest(f"over {peer.MAX_IDS} blocks")
        dtypes = {p.region.dtype for p in pairs}
        if len(dtypes) != 1:
            raise BadRequest(f"the source regions mix dtypes {sorted(dtypes)}")
        if spec.references is not None:
            if len(spec.references) != len(pairs):
                raise BadRequest(f"{len(spec.references)} reference pairs for {len(pairs)} region pairs")
            for p, (src_ref, _) in zip(pairs, spec.references):
                p.reference = self.ctx.reference_for(p.region, src_ref, spec.src_blocks, cache)
        candidates = self._candidates(spec.codec, pairs[0].region.tensor.dtype)
        book = self.codebooks.for_transfer(spec.codebook)
        if len(candidates) == 1:  # a codec asked for by name: refuse what it cannot code before sending
            entry = book if book is not None and book[0] == candidates[0] else None
            self.ctx.bind(codecs.get(candidates[0]), entry[1] if entry else None, pairs)
        elif spec.references is not None:
            raise BadRequest("reference regions are for a codec that codes against them: name it (codec=predictive)")
        transfer = Transfer(id=spec.transfer_id or os.urandom(16).hex(), direction="out", peer=spec.peer,
                            pairs=list(spec.pairs), blocks=len(spec.src_blocks), codec=spec.codec,
                            references=[p.reference.name for p in pairs if p.reference is not None])
        self.transfers.add(transfer)
        for p in pairs:
            p.region.busy.add(transfer.id)  # a shm/IPC mapping must outlive the reads of this transfer
            if p.reference is not None:
                p.reference.busy.add(transfer.id)
        transfer.redial = lambda: asyncio.create_task(
            self.outgoing.run(transfer, spec, pairs, candidates, book, (host, port)))
        if not (self.outgoing.start_leased(transfer, spec, pairs, candidates, (host, port))
                or self.outgoing.start_inline(transfer, spec, pairs, candidates, book, (host, port))):
            transfer.task = transfer.redial()
        return transfer

    async def learned(self) -> None:
        """Wait for the codebooks being learned in threads (tests; shutdown)."""
        await self.learner.settled()

    def _candidates(self, requested: str, dtype: torch.dtype) -> list[str]:
        if requested == "auto":
            names = [c.name for c in codecs.lossless() if c.supports(dtype) and c.name in self.policy.codecs]
            if not names:
                raise UnknownCodec("no lossless codec handles this dtype")
            return names
        codec = self.codec_named(requested)
        if not codec.supports(dtype):
            raise UnknownCodec(f"codec {requested!r} does not handle {dtype}")
        return [requested]

    # ---- peer links ---------------------------------------------------------------------------
    def _connection_lost(self, connection: transport.Connection, exc: Exception) -> None:
        self.leases.lost(connection)
        self.events.forget(connection)
        for t, link in self.links.lost(connection):
            self.driver.lost(t, link, exc)

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
            raise TransferFailed(f"transfer {t.id} {t.state.value}: {t.error_kind}: {t.error}", t.state.value,
                                 t.error_kind)
        raise TransferFailed(f"transfer {t.id} still {t.state.value} after {timeout:g} s", t.state.value)

    def status(self, transfer_id: str) -> dict[str, Any]:
        """Raises: NotFound."""
        return self.transfers.get(transfer_id).public()

    def cancel(self, transfer_id: str) -> dict[str, Any]:
        """Cancel a running transfer on either side; the peer is told. Its work may still run
        (``quiet``). Raises: NotFound, Conflict."""
        t = self.transfers.get(transfer_id)
        if t.state.terminal:
            raise Conflict(f"transfer {transfer_id} is already {t.state.value}")
        self.driver.cancel(t, "Cancelled", "cancelled by request")
        return t.public()

    async def quiet(self, transfer_id: str, timeout: float) -> bool:
        """Wait until nothing of a transfer runs any more: its task, which awaits to their end
        the worker threads and GPU kernels it started. Those cannot be stopped, so a transfer
        that ended (failed, cancelled) may still be decoding into its blocks for a while. True
        once nothing runs (or the transfer is not known here), False after ``timeout`` seconds."""
        t = self.transfers.find(transfer_id)
        task = None if t is None else t.task
        if task is None or task.done() or task is asyncio.current_task():
            return True
        finished, _ = await asyncio.wait({task}, timeout=timeout)  # waiting does not cancel it
        return bool(finished)

    def refresh_gauges(self) -> None:
        """Gauges that are cheaper to count at scrape time than to keep in step."""
        self.metrics.regions.set(len(self.regions))
        for direction in ("in", "out"):
            self.metrics.active.labels(direction).set(len(self.transfers.active(direction)))


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"peer must be the receiving sidecar's data address host:port, not {value!r}")
    return host, int(port)


