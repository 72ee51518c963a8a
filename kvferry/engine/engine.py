"""The sidecar's engine: regions, transfers, the data listener and the pipelines that move KV.

Sending: blocks are grouped into chunks of about ``chunk_bytes``; each chunk is encoded (in a
worker thread, so the event loop keeps the wire busy) while earlier chunks are on the wire, with
at most ``max_inflight_chunks`` encoded and unacknowledged. The receiver posts receives for the
next chunks ahead of time and decodes each one straight into the destination blocks, in order.
A transfer is done on the sender only once the receiver reports every block written.

Data-plane admission: the sender announces a transfer on the receiver's control API with a
random per-transfer secret; chunk tags are derived from that secret, and the receiver posts
receives only for those tags, so bytes that were not announced never land anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from kvferry import codec
from kvferry import transport

from .errors import BadRequest, Conflict, InvalidBlocks, NotFound, PeerError
from .metrics import Metrics
from .regions import RegionTable
from .settings import Settings
from .transfers import State, Transfer, TransferTable

log = logging.getLogger("kvferry.service")
# A GPU chunk pays ~0.2-0.3 ms of host work per codec call and ~1 ms per message over UCX
# (measured on H200s: 64 MiB messages moved at 30-45 GB/s, 256 MiB ones at 154 GB/s), so GPU
# chunks are large; on the CPU the codec is slow enough that small chunks keep the pipeline short.
GPU_CHUNK_BYTES = 256 << 20
CPU_CHUNK_BYTES = 4 << 20
CPU_MESSAGE_BYTES = 16 << 20


def chunk_tag(secret: str, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{secret}:{index}".encode(), digest_size=8).digest(), "little")


def plan_chunks(blocks: int, block_bytes: int, chunk_bytes: int) -> list[int]:
    """Blocks per chunk: about ``chunk_bytes`` of raw KV each, at least one block."""
    per_chunk = max(1, chunk_bytes // max(1, block_bytes))
    return [min(per_chunk, blocks - start) for start in range(0, blocks, per_chunk)]


@dataclass
class Estimates:
    """Throughputs (GB/s of raw bytes) for the ``auto`` codec choice: SplitZip's Appendix-B model
    (a pipeline runs at its slowest stage) plus the pipeline's fill, which decides small transfers.

    Measured beats modelled: once both codecs have recently moved transfers of about this size
    (same power of two) to this peer, ``auto`` takes the one that was faster. The model assumes
    the stages overlap perfectly, which a busy host does not give it on fast links.
    """

    encode_gbps: float = 0.0
    decode_gbps: float = 0.0
    ratio: float = 1.3
    assumed_link_gbps: float = 12.5
    link_gbps: dict[str, float] = field(default_factory=dict)
    # (peer, codec, size class) -> (GB/s of raw bytes, when last seen on time.monotonic())
    measured: dict[tuple[str, str, int], tuple[float, float]] = field(default_factory=dict)
    measured_ttl_s: float = 600.0

    def predict(self, peer: str, raw_bytes: int, chunk_bytes: int) -> tuple[float, float]:
        """Seconds for (raw, splitzip). With k chunks and per-chunk stage times e, w, d the
        pipeline takes k*max(e, w, d) + the other stages once: (e + w + d) - max(e, w, d)."""
        link = self.link_gbps.get(peer, self.assumed_link_gbps) * 1e9
        raw_s = raw_bytes / link
        if not (self.encode_gbps and self.decode_gbps and raw_bytes):
            return raw_s, math.inf
        chunk = min(raw_bytes, chunk_bytes)
        stages = (chunk / (self.encode_gbps * 1e9), chunk / (self.ratio * link), chunk / (self.decode_gbps * 1e9))
        return raw_s, raw_bytes / chunk * max(stages) + sum(stages) - max(stages)

    def choose(self, peer: str, raw_bytes: int, chunk_bytes: int, now: float | None = None) -> tuple[str, str]:
        now = time.monotonic() if now is None else now
        seen = {codec: self.measured.get((peer, codec, raw_bytes.bit_length())) for codec in ("raw", "splitzip")}
        if all(entry and now - entry[1] <= self.measured_ttl_s for entry in seen.values()):
            raw_gbps, coded_gbps = seen["raw"][0], seen["splitzip"][0]
            choice = "splitzip" if coded_gbps > raw_gbps else "raw"
            return choice, (f"measured raw {raw_gbps:.2f} vs splitzip {coded_gbps:.2f} GB/s "
                            f"for transfers of this size to this peer")
        raw_s, coded_s = self.predict(peer, raw_bytes, chunk_bytes)
        link = self.link_gbps.get(peer, self.assumed_link_gbps)
        choice = "splitzip" if coded_s < raw_s else "raw"
        reason = (f"predicted raw {raw_s * 1e3:.2f} ms vs splitzip {coded_s * 1e3:.2f} ms "
                  f"(link {link:.2f} GB/s{'' if peer in self.link_gbps else ' assumed'}, "
                  f"encode {self.encode_gbps:.2f}, decode {self.decode_gbps:.2f} GB/s, ratio {self.ratio:.3f})")
        return choice, reason

    def observe_transfer(self, peer: str, codec: str, raw_bytes: int, seconds: float, now: float | None = None) -> None:
        """A whole transfer's speed, as the worker saw it (fixed costs included)."""
        if seconds > 0 and raw_bytes >= 1 << 20:
            now = time.monotonic() if now is None else now
            key = (peer, codec, raw_bytes.bit_length())
            old = self.measured.get(key)
            fresh = old is not None and now - old[1] <= self.measured_ttl_s
            self.measured[key] = (_follow(old[0] if fresh else None, raw_bytes / seconds / 1e9), now)

    def observe_link(self, peer: str, wire_bytes: int, seconds: float) -> None:
        if seconds > 0 and wire_bytes > 1 << 20:
            self.link_gbps[peer] = _follow(self.link_gbps.get(peer), wire_bytes / seconds / 1e9)

    def observe_codec(self, direction: str, raw_bytes: int, seconds: float) -> None:
        """Follow the codec speed real chunks see (the start-up sample can be taken while the
        machine is busy starting, and a GPU shares its bandwidth with the serving engine)."""
        if seconds > 0 and raw_bytes >= 1 << 20:
            name = f"{direction}_gbps"
            setattr(self, name, _follow(getattr(self, name), raw_bytes / seconds / 1e9))

    def observe_ratio(self, raw_bytes: int, wire_bytes: int) -> None:
        """Follow the ratio real SplitZip transfers achieve (data, not the start-up sample)."""
        if wire_bytes > 1 << 20:
            self.ratio = _follow(self.ratio, raw_bytes / wire_bytes)


def _follow(old: float | None, sample: float) -> float:
    """Exponential moving average that starts at the first sample (0 or None = none yet)."""
    return sample if not old else 0.7 * old + 0.3 * sample


class BufferPool:
    """Receive buffers, reused across chunks and transfers (chunk sizes repeat), up to a bound.

    A buffer goes back only after its chunk was decoded: one whose receive failed or was
    cancelled may still be written by a late payload, so it is left to the garbage collector.
    """

    def __init__(self, max_bytes: int):
        self._free: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._bytes = 0
        self._max_bytes = max_bytes

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        stack = self._free.get((str(device), nbytes))
        if stack:
            self._bytes -= nbytes
            return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        if self._bytes + buffer.numel() <= self._max_bytes:
            self._free.setdefault((str(buffer.device), buffer.numel()), []).append(buffer)
            self._bytes += buffer.numel()


class Sidecar:
    """Everything one daemon holds; created in the app's lifespan, closed at shutdown."""

    def __init__(self, settings: Settings):
        self.settings = settings
        wanted = settings.device
        if wanted.startswith("cuda"):
            self.device = torch.device(wanted)
        else:
            self.device = torch.device("cuda" if wanted == "auto" and torch.cuda.is_available() else "cpu")
        self.regions = RegionTable(self.device)
        # Codec work runs on streams of its own, one per direction: on torch's default (legacy)
        # stream it would wait for, and hold up, UCX's copies into the same GPU, and a
        # sidecar's sends and receives would wait for each other.
        self.codec_streams = ({"encode": torch.cuda.Stream(self.device), "decode": torch.cuda.Stream(self.device)}
                              if self.device.type == "cuda" else {})
        self.transfers = TransferTable(settings.max_concurrent_transfers)
        self.metrics = Metrics()
        self.codebooks: dict[str, codec.Codebook] = {}
        # An emulated link's speed is known; otherwise assume a 100 Gb/s NIC until measured.
        self.estimates = Estimates(assumed_link_gbps=settings.link_gbps or settings.assumed_link_gbps)
        self.chunk_bytes = settings.chunk_bytes or (GPU_CHUNK_BYTES if self.device.type == "cuda" else CPU_CHUNK_BYTES)
        # On a GPU each message costs a UCX rendezvous and Python work (~0.5 ms), so a frame
        # travels whole; host memory moves in 16 MiB pieces.
        message_bytes = settings.transport_chunk_bytes or (
            self.chunk_bytes + (1 << 20) if self.device.type == "cuda" else CPU_MESSAGE_BYTES)
        self.transport_config = transport.TransportConfig(
            backend=settings.transport_backend, chunk_bytes=message_bytes,
            max_inflight_bytes=max(settings.transport_window_bytes, settings.max_inflight_chunks * message_bytes),
            op_timeout=settings.transfer_timeout, pace_bytes_per_s=settings.link_gbps * 1e9,
            ucx_options={**transport.DEFAULT_UCX_OPTIONS, **settings.ucx_options})
        self.backend = transport.resolve_backend(self.transport_config)
        self.listener: transport.Listener | None = None
        self.pool: transport.Pool | None = None
        self.http: httpx.AsyncClient | None = None
        self.buffers = BufferPool(4 * settings.max_inflight_chunks * self.chunk_bytes + (64 << 20))
        self.ready = False

    async def start(self) -> None:
        self.listener = await transport.listen(self.settings.data_host, self.settings.data_port,
                                               self.transport_config, backend=self.backend)
        self.pool = transport.Pool(self.transport_config, backend=self.backend)
        headers = {"Authorization": f"Bearer {self.settings.token}"} if self.settings.token else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.settings.transfer_timeout + 5))
        self.metrics.info.info({"version": "0.1.0", "transport_backend": self.backend, "device": str(self.device)})
        await asyncio.to_thread(self._measure_codec)
        self.ready = True
        log.info("data plane: %s listener on %s:%d; codec on %s: encode %.2f GB/s, decode %.2f GB/s",
                 self.backend, self.settings.data_host, self.listener.port, self.device,
                 self.estimates.encode_gbps, self.estimates.decode_gbps)

    def _measure_codec(self) -> None:
        """Codec throughput on this device at the pipeline's chunk size (per-call costs included,
        as the pipeline pays them), best of three after a warm-up, for the ``auto`` choice."""
        elements = min(self.chunk_bytes, GPU_CHUNK_BYTES) // 2
        sample = (torch.randn(elements, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
        sample = sample.to(self.device)
        book = codec.calibrate(sample)
        encode_s, decode_s = [], []
        for _ in range(4):
            start = time.perf_counter()
            frame = codec.encode(sample, book)
            middle = time.perf_counter()
            codec.decode(frame)
            if sample.is_cuda:
                torch.cuda.synchronize(sample.device)
            encode_s.append(middle - start)
            decode_s.append(time.perf_counter() - middle)
        raw = sample.numel() * 2
        self.estimates.encode_gbps = raw / min(encode_s[1:]) / 1e9
        self.estimates.decode_gbps = raw / min(decode_s[1:]) / 1e9

    async def close(self) -> None:
        """Stop taking work, fail what is in flight, release the data plane."""
        self.ready = False
        for t in self.transfers.all():
            if t.task is not None and not t.task.done():
                t.task.cancel()
        tasks = [t.task for t in self.transfers.all() if t.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in self.transfers.all():
            self._finish(t, State.FAILED, "the sidecar shut down")
        if self.pool is not None:
            await self.pool.close()
        if self.listener is not None:
            await self.listener.close()
        if self.http is not None:
            await self.http.aclose()
        self.regions.close()
        transport.shutdown_backends()

    # ---- bookkeeping -------------------------------------------------------------------------
    def refresh_gauges(self) -> None:
        """Gauges that are cheaper to count at scrape time than to keep in step."""
        self.metrics.regions.set(len(self.regions))
        for direction in ("in", "out"):
            active = sum(not t.state.terminal for t in self.transfers.query(direction=direction))
            self.metrics.active.labels(direction).set(active)

    def _finish(self, t: Transfer, state: State, error: str | None = None) -> None:
        if not t.move(state, error):
            return
        self.metrics.transfers.labels(state.value, t.direction).inc()
        if state == State.DONE:
            self.metrics.bytes_raw.labels(t.direction).inc(t.bytes_raw)
            self.metrics.bytes_wire.labels(t.direction).inc(t.bytes_wire)
            if t.bytes_wire:
                self.metrics.ratio.observe(t.bytes_raw / t.bytes_wire)
            if t.seconds is not None:
                self.metrics.latency.labels(t.direction).observe(t.seconds)
        elif state == State.FAILED:
            self.metrics.errors.labels(_error_kind(error)).inc()
        try:  # the region may be deleted again once no transfer uses it
            self.regions.get(t.dst_region if t.direction == "in" else t.src_region).busy.discard(t.id)
        except NotFound:
            pass

    def _codebook(self, name: str | None, dtype: str) -> codec.Codebook | None:
        if name is None:
            return None  # each chunk calibrates on itself; frames carry their codebook
        try:
            book = self.codebooks[name]
        except KeyError:
            raise NotFound(f"no codebook named {name!r}") from None
        if book.dtype != dtype:
            raise BadRequest(f"codebook {name!r} is for {book.dtype}, the region holds {dtype}")
        return book

    # ---- sending -------------------------------------------------------------------------------
    def submit(self, request: dict[str, Any]) -> Transfer:
        """Validate an outgoing transfer and start it.

        Raises:
            NotFound, InvalidBlocks, BadRequest, Overloaded.
        """
        region = self.regions.get(request["src_region"])
        region.check_blocks(request["src_blocks"])
        if len(request["dst_blocks"]) != len(request["src_blocks"]):
            raise InvalidBlocks("src_blocks and dst_blocks differ in length")
        self._codebook(request.get("codebook"), region.dtype)
        transfer = Transfer(id=request.get("id") or _new_id(), direction="out", src_region=region.name,
                            src_blocks=list(request["src_blocks"]), dst_region=request["dst_region"],
                            dst_blocks=list(request["dst_blocks"]), peer=request["peer"].rstrip("/"),
                            codec=request["codec"])
        self.transfers.add(transfer)
        region.busy.add(transfer.id)  # a shm/IPC mapping must outlive the reads of this transfer
        transfer.task = asyncio.create_task(self._run_outgoing(transfer, request.get("codebook")))
        return transfer

    async def _run_outgoing(self, t: Transfer, codebook_name: str | None) -> None:
        try:
            await self._send(t, codebook_name)
        except asyncio.CancelledError:
            self._finish(t, State.CANCELLED, t.error or "cancelled")
            await self._tell_peer_cancel(t)
        except Exception as exc:
            reason = _describe(exc)
            log.warning("transfer %s failed: %s", t.id, reason)
            self._finish(t, State.FAILED, reason)
            await self._tell_peer_cancel(t)

    async def _send(self, t: Transfer, codebook_name: str | None) -> None:
        started = time.perf_counter()
        region = self.regions.get(t.src_region)
        ids = region.check_blocks(t.src_blocks)
        book = self._codebook(codebook_name, region.dtype)
        t.move(State.RUNNING)
        raw_bytes = len(t.src_blocks) * region.block_bytes
        if t.codec == "auto":
            t.chosen_codec, t.choice_reason = self.estimates.choose(t.peer, raw_bytes, self.chunk_bytes)
        else:
            t.chosen_codec, t.choice_reason = t.codec, "requested"
        plan = plan_chunks(len(t.src_blocks), region.block_bytes, self.chunk_bytes)
        announce = {"id": t.id, "secret": t.secret, "dst_region": t.dst_region, "dst_blocks": t.dst_blocks,
                    "dtype": region.dtype, "block_shape": list(region.block_shape), "codec": t.chosen_codec,
                    "chunks": plan}
        reply = await self._peer_call("POST", f"{t.peer}/v1/incoming", json=announce)
        host = reply.get("data_host") or urlsplit(t.peer).hostname
        connection = await self.pool.get(host, int(reply["data_port"]))
        slots = asyncio.Semaphore(self.settings.max_inflight_chunks)
        sends: list[asyncio.Task] = []
        wire_start = time.perf_counter()
        try:
            start = 0
            for index, count in enumerate(plan):
                await slots.acquire()
                if any(task.done() and task.exception() for task in sends):
                    break
                chunk_ids = ids[start:start + count]
                start += count
                payload = await asyncio.to_thread(self._encode_chunk, region, chunk_ids, t.chosen_codec, book, index)
                t.bytes_raw += count * region.block_bytes
                t.bytes_wire += payload.numel()
                self.metrics.inflight_chunks.inc()
                sends.append(asyncio.create_task(self._send_chunk(connection, t, index, payload, slots)))
            await asyncio.gather(*sends)
        finally:
            for task in sends:
                task.cancel()
        self.metrics.wire_seconds.inc(time.perf_counter() - wire_start)
        self.estimates.observe_link(t.peer, t.bytes_wire, time.perf_counter() - wire_start)
        if t.chosen_codec == "splitzip":
            self.estimates.observe_ratio(t.bytes_raw, t.bytes_wire)
        # Done only when the receiver has written every block.
        final = await self._peer_call("GET", f"{t.peer}/v1/transfers/{t.id}",
                                      params={"wait": self.settings.transfer_timeout})
        if final["state"] != "done":
            raise PeerError(f"receiver reports {final['state']}: {final.get('error')}")
        t.blocks_done = len(t.src_blocks)
        self._finish(t, State.DONE)
        self.estimates.observe_transfer(t.peer, t.chosen_codec, raw_bytes, time.perf_counter() - started)

    def _codec_stream(self, direction: str, tensor: torch.Tensor):
        stream = self.codec_streams.get(direction)
        return torch.cuda.stream(stream) if tensor.is_cuda and stream is not None else contextlib.nullcontext()

    def _encode_chunk(self, region, chunk_ids: torch.Tensor, chosen: str, book, index: int) -> torch.Tensor:
        with self._codec_stream("encode", region.tensor):
            return self._encode_on_stream(region, chunk_ids, chosen, book, index)

    def _encode_on_stream(self, region, chunk_ids: torch.Tensor, chosen: str, book, index: int) -> torch.Tensor:
        started = time.perf_counter()
        if chosen == "splitzip":
            payload = codec.encode_blocks(region.tensor, chunk_ids, book)
        else:
            bits = codec.layout_by_name(region.dtype).int_dtype
            payload = region.tensor.view(bits).index_select(0, chunk_ids).reshape(-1).view(torch.uint8)
        if index == self.settings.fault_corrupt_chunk:
            payload = payload.clone()
            payload[20] ^= 0xFF  # inside a frame's header: the receiver must reject it
        self._codec_done("encode", payload, chosen, len(chunk_ids) * region.block_bytes, started)
        return payload

    async def _send_chunk(self, connection, t: Transfer, index: int, payload: torch.Tensor,
                          slots: asyncio.Semaphore) -> None:
        try:
            await connection.send(chunk_tag(t.secret, index), payload)
        finally:
            self.metrics.inflight_chunks.dec()
            slots.release()

    async def _peer_call(self, method: str, url: str, **kwargs) -> dict[str, Any]:
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise PeerError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                body = response.json()
                detail = f"{body.get('error')}: {body.get('detail')}"
            except ValueError:
                detail = response.text[:200]
            raise PeerError(f"peer answered {response.status_code} to {method} {urlsplit(url).path}: {detail}")
        return response.json()

    async def _tell_peer_cancel(self, t: Transfer) -> None:
        try:
            await self.http.delete(f"{t.peer}/v1/transfers/{t.id}", timeout=2.0)
        except Exception:  # best effort: the receiver times out on its own
            pass

    def cancel(self, transfer_id: str) -> Transfer:
        t = self.transfers.get(transfer_id)
        if t.state.terminal:
            raise Conflict(f"transfer {transfer_id} is already {t.state.value}")
        t.error = "cancelled by request"
        if t.task is not None:
            t.task.cancel()
        else:
            self._finish(t, State.CANCELLED, t.error)
        return t

    # ---- receiving -------------------------------------------------------------------------------
    def accept_incoming(self, request: dict[str, Any], peer_host: str | None) -> dict[str, Any]:
        """Validate an announced transfer against the destination region and post its receives.

        Raises:
            NotFound, InvalidBlocks, BadRequest, Conflict, Overloaded.
        """
        region = self.regions.get(request["dst_region"])
        if request["dtype"] != region.dtype or tuple(request["block_shape"]) != region.block_shape:
            raise BadRequest(f"region {region.name!r} holds {region.dtype}{list(region.block_shape)} blocks, "
                             f"the transfer carries {request['dtype']}{request['block_shape']}")
        region.check_blocks(request["dst_blocks"])
        if sum(request["chunks"]) != len(request["dst_blocks"]) or min(request["chunks"], default=0) <= 0:
            raise BadRequest("chunk plan does not cover the blocks")
        if request["codec"] not in ("splitzip", "raw"):
            raise BadRequest(f"unknown codec {request['codec']!r}")
        transfer = Transfer(id=request["id"], direction="in", src_region="", src_blocks=[],
                            dst_region=region.name, dst_blocks=list(request["dst_blocks"]),
                            peer=peer_host or "", codec=request["codec"], chosen_codec=request["codec"],
                            secret=request["secret"])
        self.transfers.add(transfer)
        region.busy.add(transfer.id)
        transfer.move(State.RUNNING)
        transfer.task = asyncio.create_task(self._run_incoming(transfer, list(request["chunks"])))
        return {"id": transfer.id, "data_host": self.settings.advertise_host, "data_port": self.listener.port,
                "backend": self.backend}

    async def _run_incoming(self, t: Transfer, plan: list[int]) -> None:
        receives: dict[int, transport.Receive] = {}
        try:
            region = self.regions.get(t.dst_region)
            ids = region.check_blocks(t.dst_blocks)
            capacities = [self._chunk_capacity(region, count, t.chosen_codec) for count in plan]
            ahead = self.settings.max_inflight_chunks + 1
            starts = [sum(plan[:i]) for i in range(len(plan))]

            def post(i: int) -> None:
                if i < len(plan) and i not in receives:
                    buffer = self.buffers.take(capacities[i], region.tensor.device)
                    receives[i] = self.listener.expect(chunk_tag(t.secret, i), buffer)

            for i in range(ahead):
                post(i)
            for i, count in enumerate(plan):
                receive = receives[i]
                nbytes = await receive.wait(self.settings.transfer_timeout)
                post(i + ahead)
                frame = receive.buffer.obj[:nbytes]
                await asyncio.to_thread(self._decode_chunk, region, frame, ids[starts[i]:starts[i] + count],
                                        t.chosen_codec, i)
                self.buffers.give(receives.pop(i).buffer.obj)
                t.bytes_wire += nbytes
                t.bytes_raw += count * region.block_bytes
                t.blocks_done += count
            self._finish(t, State.DONE)
        except asyncio.CancelledError:
            self._finish(t, State.CANCELLED, t.error or "cancelled")
        except Exception as exc:
            reason = _describe(exc)
            log.warning("incoming transfer %s failed: %s", t.id, reason)
            self._finish(t, State.FAILED, reason)
        finally:
            for receive in receives.values():
                receive.cancel()

    def _chunk_capacity(self, region, count: int, chosen: str) -> int:
        if chosen == "raw":
            return count * region.block_bytes
        return codec.frame_capacity((count, *region.block_shape), region.tensor.dtype)

    def _decode_chunk(self, region, frame: torch.Tensor, chunk_ids: torch.Tensor, chosen: str, index: int) -> None:
        with self._codec_stream("decode", region.tensor):
            self._decode_on_stream(region, frame, chunk_ids, chosen, index)

    def _decode_on_stream(self, region, frame: torch.Tensor, chunk_ids: torch.Tensor, chosen: str, index: int) -> None:
        started = time.perf_counter()
        if chosen == "splitzip":
            try:
                codec.decode_blocks(frame, region.tensor, chunk_ids)
            except codec.CodecError as exc:
                raise BadRequest(f"chunk {index}: {type(exc).__name__}: {exc}") from exc
        else:
            expected = len(chunk_ids) * region.block_bytes
            if frame.numel() != expected:
                raise BadRequest(f"chunk {index}: {frame.numel()} raw bytes, expected {expected}")
            bits = codec.layout_by_name(region.dtype).int_dtype
            blocks = frame.view(bits).view(len(chunk_ids), *region.block_shape)
            region.tensor.view(bits).index_copy_(0, chunk_ids, blocks)
        self._codec_done("decode", frame, chosen, len(chunk_ids) * region.block_bytes, started)

    def _codec_done(self, direction: str, tensor: torch.Tensor, chosen: str, raw_bytes: int, started: float) -> None:
        """Wait for the chunk's GPU work, then account its time (metrics, and ``auto``'s estimates)."""
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        seconds = time.perf_counter() - started
        self.metrics.codec_seconds.labels(direction).inc(seconds)
        if chosen == "splitzip":
            self.estimates.observe_codec(direction, raw_bytes, seconds)


def _new_id() -> str:
    import uuid

    return uuid.uuid4().hex


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _error_kind(error: str | None) -> str:
    if not error:
        return "unknown"
    return error.split(":", 1)[0]
