"""``GrpcClient``: the asyncio SDK over the gRPC control plane (``kvferry serve --grpc-port``),
with the calls of ``AsyncClient`` (REST) and the same typed handles, plus ``watch``: transfer
events pushed by the sidecar, re-dialled with backoff across restarts. Needs the grpc extra
(``pip install kvferry[grpc]``); ``kvferry.client`` itself imports without it."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvferry.engine.errors import BY_NAME, EngineError, NotFound, Overloaded, TransferFailed
from kvferry.proto import convert
from kvferry.proto.v1 import (codebooks_pb2, codebooks_pb2_grpc, health_pb2, health_pb2_grpc, regions_pb2,
                              regions_pb2_grpc, transfers_pb2, transfers_pb2_grpc)

from .handle import AsyncHandles, AsyncTransfer, TransferStatus, awaited
from .sdk import Blocks, blocks_json

# A stream broken by these is dialled again (the sidecar restarted, shut down, or the connection dropped).
REDIAL = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
SEEN = 4096  # transfers whose last state a watch remembers, not to yield it again on a resubscription
KINDS = {transfers_pb2.EVENT_KIND_SNAPSHOT: "snapshot", transfers_pb2.EVENT_KIND_CHANGED: "changed",
         transfers_pb2.EVENT_KIND_NOT_FOUND: "not_found"}


@dataclass(frozen=True)
class TransferEvent:
    """``kind``: "snapshot" (its state when the watch (re)started), "changed", or "not_found" (the
    sidecar holds no such transfer: unknown, forgotten, or lost in a restart; ``status`` None)."""

    kind: str
    id: str
    status: TransferStatus | None


def engine_error(exc: grpc.RpcError) -> EngineError | None:
    """The engine's error class the sidecar named in the trailing metadata, raised-ready; None for
    a failure of the call itself (the sidecar unreachable, a deadline)."""
    named = dict(exc.trailing_metadata() or ())
    name = named.get("kvferry-error")
    if name is None:
        return None
    cls = BY_NAME.get(name, EngineError)
    if cls is TransferFailed:
        return TransferFailed(exc.details() or "", named.get("kvferry-state", "failed"), named.get("kvferry-kind"))
    return cls(f"{exc.code().name}: {exc.details()}")


class GrpcClient(AsyncHandles):
    """One sidecar's gRPC control plane. ``target``: ``host:port``; ``submitter``: the tag this
    client's transfers carry, which ``watch(mine=True)`` selects (default: one of its own)."""

    def __init__(self, target: str, token: str | None = None, timeout: float = 60.0, retries: int = 6,
                 submitter: str | None = None):
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
            # a restarted sidecar is dialled again within 2 s (gRPC's default backs off to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout, self._retries = timeout, retries
        self.submitter = submitter or uuid.uuid4().hex
        self._regions = regions_pb2_grpc.RegionsServiceStub(self._channel)
        self._transfers = transfers_pb2_grpc.TransfersServiceStub(self._channel)
        self._codebooks = codebooks_pb2_grpc.CodebooksServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthServiceStub(self._channel)

    async def aclose(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> GrpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: Any, request: Any, wait: float = 0.0) -> Any:
        """One call, within the client's timeout (plus ``wait``), tried again while the sidecar
        answers Overloaded; the engine's error classes raised back."""
        delay = 0.05
        for attempt in range(self._retries + 1):
            try:
                return await method(request, metadata=self._metadata, timeout=self._timeout + wait)
            except grpc.aio.AioRpcError as exc:
                error = engine_error(exc)
                if error is None:
                    raise
                if not isinstance(error, Overloaded) or attempt == self._retries:
                    raise error from None
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(2.0, delay * 2)

    # ---- regions -----------------------------------------------------------------------------
    async def create_region(self, name: str, num_blocks: int, block_shape: Sequence[int], dtype: str,
                            kind: str = "owned", **kind_fields: Any) -> dict:
        request = regions_pb2.CreateRegionRequest(name=name, kind=kind, num_blocks=num_blocks,
                                                  block_shape=list(block_shape), dtype=dtype, **kind_fields)
        return convert.region_record((await self._call(self._regions.CreateRegion, request)).region)

    async def region(self, name: str) -> dict:
        return convert.region_record((await self._call(self._regions.GetRegion,
                                                       regions_pb2.GetRegionRequest(name=name))).region)

    async def list_regions(self) -> list[dict]:
        answer = await self._call(self._regions.ListRegions, regions_pb2.ListRegionsRequest())
        return [convert.region_record(r) for r in answer.regions]

    async def delete_region(self, name: str, force: bool = False, drain: float = 0.0) -> None:
        """As ``Client.delete_region``."""
        await self._call(self._regions.DeleteRegion,
                         regions_pb2.DeleteRegionRequest(name=name, force=force, drain_seconds=drain), wait=drain)

    async def put_blocks(self, name: str, start: int, count: int, data: bytes) -> None:
        await self._call(self._regions.PutBlocks, regions_pb2.PutBlocksRequest(name=name, start=start, count=count,
                                                                               data=data))

    async def get_block(self, name: str, index: int) -> bytes:
        return (await self._call(self._regions.GetBlock, regions_pb2.GetBlockRequest(name=name, index=index))).data

    # ---- transfers ---------------------------------------------------------------------------
    def _submit_request(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str, dst_blocks: Blocks,
                        codec: str, codebook: str | None, wait: float) -> transfers_pb2.SubmitRequest:
        return submit_request(self.submitter, pairs, src_blocks, peer, dst_blocks, codec, codebook, wait)

    async def _submit(self, request: transfers_pb2.SubmitRequest) -> dict:
        return convert.transfer_record((await self._call(self._transfers.Submit, request, request.wait)).transfer)

    async def submit(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                     codec: str = "auto", codebook: str | None = None, *, wait: float = 0,
                     references: tuple[str, str] | None = None) -> str:
        """As ``Client.submit``: the transfer's id."""
        pair = (src_region, dst_region, *(references or ()))
        return (await self._submit(self._submit_request([pair], src_blocks, peer, dst_blocks, codec, codebook,
                                                        wait)))["id"]

    async def submit_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str,
                             dst_blocks: Blocks, codec: str = "auto", codebook: str | None = None, *,
                             wait: float = 0) -> str:
        return (await self._submit(self._submit_request(pairs, src_blocks, peer, dst_blocks, codec, codebook,
                                                        wait)))["id"]

    async def start(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                    codec: str = "auto", codebook: str | None = None, *,
                    references: tuple[str, str] | None = None) -> AsyncTransfer:
        """``submit``, answered with a typed handle (``await t.wait()``)."""
        pair = (src_region, dst_region, *(references or ()))
        return self._handle(await self._submit(self._submit_request([pair], src_blocks, peer, dst_blocks, codec,
                                                                    codebook, 0)))

    async def start_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str,
                            dst_blocks: Blocks, codec: str = "auto", codebook: str | None = None) -> AsyncTransfer:
        return self._handle(await self._submit(self._submit_request(pairs, src_blocks, peer, dst_blocks, codec,
                                                                    codebook, 0)))

    async def transfer(self, transfer_id: str, wait: float = 0, appear: float = 0) -> dict:
        """A transfer's record (never raises for its state); ``wait``: long-poll for its end;
        ``appear``: first wait that long for a transfer a peer is about to announce here."""
        request = transfers_pb2.GetRequest(id=transfer_id, wait=wait, appear=appear)
        answer = await self._call(self._transfers.Get, request, wait)
        return convert.transfer_record(answer.transfer)

    async def wait(self, transfer_id: str, timeout: float = 60.0) -> dict:
        """As ``Client.wait``. Raises: TransferFailed."""
        return dict((await awaited(self._snapshot, transfer_id, timeout)).record)

    async def cancel(self, transfer_id: str) -> dict:
        answer = await self._call(self._transfers.Cancel, transfers_pb2.CancelRequest(id=transfer_id))
        return convert.transfer_record(answer.transfer)

    async def watch(self, ids: Sequence[str] = (), *, mine: bool = False, follow: bool = False,
                    reconnect_timeout: float = 60.0, since: float = 0.0,
                    on_redial: Callable[[], object] | None = None) -> AsyncIterator[TransferEvent]:
        """Events of the transfers ``ids``; without ids, of this client's transfers (``mine``) or of
        every transfer of the sidecar. First the current state of each, then each change; without
        ``follow`` it ends once every watched transfer has ended. A broken stream is dialled again
        with jittered backoff and resubscribed (the current states sent again; a state already
        yielded is not repeated) until the sidecar has been unreachable ``reconnect_timeout`` seconds.
        Without ids, a resubscription also catches up on the transfers that started since the watch
        began and ended while it was away (as far as the sidecar's history reaches); ``since`` (a
        wall-clock time) catches up from then on the first subscription too, so a transfer submitted
        before the stream registered is not missed. ``on_redial`` is called each time the stream
        broke and is dialled again: a restarted sidecar forgot its transfers, and a caller waiting
        for one asks for it another way.

        Raises:
            EngineError (bad input, the token refused), grpc.aio.AioRpcError (unreachable too long).
        """
        request = transfers_pb2.WatchRequest(ids=list(ids), submitter=self.submitter if mine and not ids else "",
                                             follow=follow, since=since if not ids else 0.0)
        began = time.time() - 1.0  # the sidecar's clock may be a little behind (it is on this host)
        if since and not ids:
            began = min(began, since)
        seen: OrderedDict[str, str] = OrderedDict()  # id -> the state last yielded, the latest SEEN of them
        delay, down_since = 0.05, None
        while True:
            try:
                async for message in self._transfers.Watch(request, metadata=self._metadata):
                    delay, down_since = 0.05, None
                    event = _event(message)
                    state = event.status.state if event.status is not None else event.kind
                    if seen.get(event.id) != state:
                        seen[event.id] = state
                        seen.move_to_end(event.id)
                        if len(seen) > SEEN:
                            seen.popitem(last=False)
                        yield event
                return
            except grpc.aio.AioRpcError as exc:
                error = engine_error(exc)
                if error is not None and not isinstance(error, Overloaded):
                    raise error from None
                if error is None and exc.code() not in REDIAL:
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > reconnect_timeout:
                    raise
                if not ids:
                    request.since = began
                if on_redial is not None:
                    on_redial()
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(2.0, delay * 2)

    # ---- codebooks and health ----------------------------------------------------------------
    async def put_codebook(self, name: str, codebook_json: str, codec: str = "splitzip") -> dict:
        request = codebooks_pb2.PutCodebookRequest(name=name, codec=codec, document=codebook_json)
        book = (await self._call(self._codebooks.PutCodebook, request)).codebook
        return {"name": book.name, "codec": book.codec, "digest": book.digest}

    async def codebook(self, name: str) -> str:
        """The stored codebook's JSON document."""
        return (await self._call(self._codebooks.GetCodebook, codebooks_pb2.GetCodebookRequest(name=name))).document

    async def calibrate(self, name: str, region: str, blocks: Blocks, codec: str = "splitzip",
                        token_axis: int | None = None, **options: Any) -> dict:
        request = codebooks_pb2.CalibrateRequest(name=name, region=region, codec=codec, token_axis=token_axis,
                                                 blocks=convert.blocks_message(blocks_json(blocks)),
                                                 options_json=json.dumps(options))
        book = (await self._call(self._codebooks.Calibrate, request)).codebook
        return {"name": book.name, "codec": book.codec, "digest": book.digest}

    async def health(self) -> dict:
        answer = await self._call(self._health.GetHealth, health_pb2.GetHealthRequest())
        return {"status": answer.status, "version": answer.version, "backend": answer.backend,
                "device": answer.device, "data_address": answer.data_address, "codecs": list(answer.codecs),
                "max_body_bytes": answer.max_body_bytes}

    async def data_address(self) -> str:
        return (await self.health())["data_address"]


def submit_request(submitter: str, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str, dst_blocks: Blocks,
                    codec: str, codebook: str | None, wait: float, transfer_id: str = "") -> transfers_pb2.SubmitRequest:
    """A SubmitRequest of the SDK's arguments, tagged ``submitter``."""
    regions = []
    for pair in pairs:
        if len(pair) not in (2, 4):
            raise ValueError(f"a region pair is (src, dst) or (src, dst, src_reference, dst_reference), not {pair!r}")
        regions.append(transfers_pb2.RegionPair(src=pair[0], dst=pair[1], **(
            {"src_reference": pair[2], "dst_reference": pair[3]} if len(pair) == 4 else {})))
    return transfers_pb2.SubmitRequest(
        peer=peer, regions=regions, src_blocks=convert.blocks_message(blocks_json(src_blocks)),
        dst_blocks=convert.blocks_message(blocks_json(dst_blocks)), codec=codec, codebook=codebook, wait=wait,
        submitter=submitter, id=transfer_id)


class Watched:
    """A transfer started by ``GrpcSender.start``: its record once started (``record``), its end
    read by ``end`` on the calling thread."""

    def __init__(self, call: Any, record: dict[str, Any]):
        self._call, self.record = call, record
        self.id: str = record["id"]

    def end(self) -> dict[str, Any] | None:
        """The transfer's record at its end; None where the stream ended first (its ``wait``
        passed, or ``cancel``). Blocks until then, at most the call's deadline.

        Raises:
            grpc.RpcError: the stream broke (the sidecar unreachable, restarted).
        """
        if self.record["state"] in TERMINAL:
            return self.record
        for message in self._call:
            self.record = convert.transfer_record(message.transfer)
            if self.record["state"] in TERMINAL:
                return self.record
        return None

    def cancel(self) -> None:
        """Stop watching (any thread): ``end`` returns None or raises CANCELLED; the transfer goes on."""
        self._call.cancel()


class Ending:
    """A Watch of one transfer begun by ``GrpcSender.watch_end``, its end read by ``result``."""

    def __init__(self, call: Any, transfer_id: str):
        self._call, self.id = call, transfer_id

    def result(self) -> dict[str, Any] | None:
        """The transfer's record at its end, on this thread; None where the call's ``wait`` passed first.

        Raises:
            NotFound: it did not appear within the watch's ``appear`` seconds. EngineError (the
            watch refused), grpc.RpcError: the stream broke.
        """
        try:
            for message in self._call:
                record = convert.transfer_record(message.transfer)
                if record["state"] in TERMINAL:
                    return record
            return None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            error = engine_error(exc)
            raise error if error is not None else exc from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class GrpcSender:
    """A blocking client of one call, ``SubmitAndWatch``, for worker threads that wait for their
    own transfers: the calling thread itself reads the stream (grpc's single-threaded server
    streams), so a transfer's end reaches it without a hop through another thread or event loop.
    ``token``, ``timeout``, ``retries`` and ``submitter`` as ``GrpcClient``'s."""

    def __init__(self, target: str, token: str | None = None, timeout: float = 60.0, retries: int = 6,
                 submitter: str | None = None):
        self._channel = grpc.insecure_channel(target, options=[
            ("SingleThreadedUnaryStream", 1),  # grpc.experimental.ChannelOptions: the caller reads the stream
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout, self._retries = timeout, retries
        self.submitter = submitter or uuid.uuid4().hex
        self._transfers = transfers_pb2_grpc.TransfersServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
              codec: str = "auto", codebook: str | None = None, *, wait: float,
              references: tuple[str, str] | None = None) -> Watched:
        """Start a transfer whose end the stream brings within ``wait`` seconds (0 to 300); tried
        again while the sidecar answers Overloaded, as ``GrpcClient``'s calls are.

        Raises:
            EngineError (refused, as ``GrpcClient.submit`` raises), grpc.RpcError (unreachable).
        """
        pair = (src_region, dst_region, *(references or ()))
        submit = submit_request(self.submitter, [pair], src_blocks, peer, dst_blocks, codec, codebook, wait)
        request = transfers_pb2.SubmitAndWatchRequest(submit=submit)
        def started() -> Watched:
            call = self._transfers.SubmitAndWatch(request, metadata=self._metadata, timeout=self._timeout + wait)
            try:
                return Watched(call, convert.transfer_record(next(call).transfer))
            except StopIteration:
                raise EngineError("the sidecar ended SubmitAndWatch without the transfer's record") from None

        return self._retried(started)

    def send(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
             codec: str = "auto", *, wait: float, transfer_id: str = "") -> dict[str, Any]:
        """As ``Client.send``: one ``Submit`` that answers at the transfer's end, read on this
        thread (one message: a stream's first would hold its end back until the sidecar's event
        loop has seen it sent); the record is still queued or running where ``wait`` passed first.

        Raises:
            TransferFailed (it failed or was cancelled), EngineError (refused), grpc.RpcError.
        """
        request = submit_request(self.submitter, [(src_region, dst_region)], src_blocks, peer, dst_blocks, codec,
                                 None, wait, transfer_id)
        return convert.transfer_record(self._call(self._transfers.Submit, request, wait).transfer)

    def send_later(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                   codec: str = "auto", *, transfer_id: str = "") -> Callable[[], dict[str, Any]]:
        """``send`` without waiting for the end, split: the Submit leaves now, and the function
        returned reads its record (once started) later, on any thread.

        Raises (the function): EngineError (refused), grpc.RpcError (unreachable)."""
        request = submit_request(self.submitter, [(src_region, dst_region)], src_blocks, peer, dst_blocks, codec,
                                 None, 0, transfer_id)
        future = self._transfers.Submit.future(request, metadata=self._metadata, timeout=self._timeout)

        def result() -> dict[str, Any]:
            try:
                return convert.transfer_record(future.result().transfer)
            except grpc.RpcError as exc:
                error = engine_error(exc)
                if error is None:
                    raise
                if not isinstance(error, Overloaded):
                    raise error from None
            return convert.transfer_record(self._call(self._transfers.Submit, request, 0).transfer)  # tried again

        return result

    def ended(self, transfer_id: str, wait: float, appear: float) -> dict[str, Any] | None:
        """``watch_end(...).result()``: the record of transfer ``transfer_id`` at its end, or None
        where ``wait`` passed first. Raises: as ``Ending.result``."""
        return self.watch_end(transfer_id, wait, appear).result()

    def watch_end(self, transfer_id: str, wait: float, appear: float) -> Ending:
        """Start a ``Watch`` of transfer ``transfer_id`` (on a receiver's sidecar, one a peer is
        about to announce: ``appear`` is how long to wait for it first); its end is read by
        ``Ending.result`` on the calling thread, so the watch can be asked for before the transfer
        is submitted elsewhere."""
        request = transfers_pb2.WatchRequest(ids=[transfer_id], follow=True, appear=appear)
        return Ending(self._transfers.Watch(request, metadata=self._metadata, timeout=wait), transfer_id)

    def _call(self, method: Any, request: Any, wait: float) -> Any:
        """One blocking call, tried again while the sidecar answers Overloaded (as ``GrpcClient``'s)."""
        return self._retried(lambda: method(request, metadata=self._metadata, timeout=self._timeout + wait))

    def _retried(self, attempt: Callable[[], Any]) -> Any:
        """``attempt()``, made again with jittered backoff while the sidecar answers Overloaded."""
        delay = 0.05
        for tried in range(self._retries + 1):
            try:
                return attempt()
            except grpc.RpcError as exc:
                error = engine_error(exc)
                if error is None:
                    raise
                if not isinstance(error, Overloaded) or tried == self._retries:
                    raise error from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(2.0, delay * 2)
        raise AssertionError("unreachable")


TERMINAL = ("done", "failed", "cancelled")


def _event(message: transfers_pb2.WatchResponse) -> TransferEvent:
    kind = KINDS.get(message.kind, "changed")
    status = None if kind == "not_found" else TransferStatus.from_record(convert.transfer_record(message.transfer))
    return TransferEvent(kind, message.transfer.id, status)
