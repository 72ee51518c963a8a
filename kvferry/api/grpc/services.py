"""The kvferry.v1 services: each call validates its message into the REST API's request model
and calls what the REST handler calls (``kvferry/api/ops.py``); engine errors become statuses
through the one map (``kvferry/api/errors.py``), by ``translated``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from pydantic import ValidationError

from kvferry.engine.engine import Engine
from kvferry.engine.errors import BadRequest, EngineError, NotFound, Overloaded
from kvferry.engine.transfers import Transfer
from kvferry.proto import convert
from kvferry.proto.v1 import (codebooks_pb2, codebooks_pb2_grpc, health_pb2, health_pb2_grpc, regions_pb2,
                              regions_pb2_grpc, transfers_pb2, transfers_pb2_grpc)

from .. import errors, ops
from ..models import CalibrateBody, RegionBody, TransferBody
from .watch import Hub

HEARTBEAT = 30.0  # a Watch with nothing to say looks at its stream this often
TERMINAL = ("done", "failed", "cancelled")
EVENT_KINDS = {"snapshot": transfers_pb2.EVENT_KIND_SNAPSHOT, "changed": transfers_pb2.EVENT_KIND_CHANGED,
               "not_found": transfers_pb2.EVENT_KIND_NOT_FOUND}


async def abort(context: grpc.aio.ServicerContext, exc: EngineError) -> None:
    """End the call with ``exc``'s status; its class (and a failed transfer's state and kind) in the
    trailing metadata, for the SDK to raise the same class back."""
    metadata = tuple((f"kvferry-{key}", value) for key, value in errors.details(exc).items())
    await context.abort(grpc.StatusCode[errors.grpc_code_of(exc)], str(exc), trailing_metadata=metadata)


def _engine_error(exc: Exception) -> EngineError:
    if isinstance(exc, ValidationError):
        return BadRequest(errors.plain(exc.errors()))
    return exc


def translated(method: Callable) -> Callable:
    """A servicer method whose engine and validation errors end the call with their mapped status."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except (EngineError, ValidationError) as exc:
                await abort(context, _engine_error(exc))
        return stream

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (EngineError, ValidationError) as exc:
            await abort(context, _engine_error(exc))
    return unary


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


class Regions(regions_pb2_grpc.RegionsServiceServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    @translated
    async def CreateRegion(self, request: regions_pb2.CreateRegionRequest, context: Any
                           ) -> regions_pb2.CreateRegionResponse:
        body = RegionBody.model_validate({
            "name": request.name, "kind": request.kind or "owned", "num_blocks": request.num_blocks,
            "block_shape": list(request.block_shape), "dtype": request.dtype, "axes": list(request.axes) or None,
            "shm_name": _optional(request, "shm_name"), "ipc_handle": _optional(request, "ipc_handle"),
            "device": _optional(request, "device"), "offset": request.offset})
        return regions_pb2.CreateRegionResponse(region=convert.region_message(
            await ops.create_region(self.engine, body)))

    @translated
    async def GetRegion(self, request: regions_pb2.GetRegionRequest, context: Any) -> regions_pb2.GetRegionResponse:
        return regions_pb2.GetRegionResponse(region=convert.region_message(
            self.engine.regions.get(request.name).describe()))

    @translated
    async def ListRegions(self, request: regions_pb2.ListRegionsRequest, context: Any
                          ) -> regions_pb2.ListRegionsResponse:
        return regions_pb2.ListRegionsResponse(
            regions=[convert.region_message(r.describe()) for r in self.engine.regions.all()])

    @translated
    async def DeleteRegion(self, request: regions_pb2.DeleteRegionRequest, context: Any
                           ) -> regions_pb2.DeleteRegionResponse:
        await self.engine.delete_region(request.name, request.force, request.drain_seconds)
        return regions_pb2.DeleteRegionResponse()

    @translated
    async def PutBlocks(self, request: regions_pb2.PutBlocksRequest, context: Any) -> regions_pb2.PutBlocksResponse:
        ops.write_blocks(self.engine, request.name, request.start, request.count, request.data)
        return regions_pb2.PutBlocksResponse()

    @translated
    async def GetBlock(self, request: regions_pb2.GetBlockRequest, context: Any) -> regions_pb2.GetBlockResponse:
        return regions_pb2.GetBlockResponse(data=self.engine.read_block(request.name, request.index))


class Transfers(transfers_pb2_grpc.TransfersServiceServicer):
    def __init__(self, engine: Engine, hub: Hub):
        self.engine, self.hub = engine, hub

    def _start(self, request: transfers_pb2.SubmitRequest) -> tuple[Transfer, float]:
        """The transfer started, tagged with its submitter, and the request's checked ``wait``."""
        pairs = [{"src": p.src, "dst": p.dst, "src_reference": _optional(p, "src_reference"),
                  "dst_reference": _optional(p, "dst_reference")} for p in request.regions]
        body = TransferBody.model_validate({
            "peer": request.peer, "regions": pairs or None, "src_blocks": convert.blocks_form(request.src_blocks),
            "dst_blocks": convert.blocks_form(request.dst_blocks), "codec": request.codec or "auto",
            "codebook": _optional(request, "codebook"), "id": request.id or None})
        wait = ops.check_wait(request.wait)
        t = ops.start_transfer(self.engine, body)
        self.hub.tag(t, request.submitter)
        return t, wait

    @translated
    async def Submit(self, request: transfers_pb2.SubmitRequest, context: Any) -> transfers_pb2.SubmitResponse:
        t, wait = self._start(request)
        record, status = await ops.settle(self.engine, t, wait)
        if status != 200:
            record = t.public()
        return transfers_pb2.SubmitResponse(transfer=convert.transfer_message(record))

    @translated
    async def Get(self, request: transfers_pb2.GetRequest, context: Any) -> transfers_pb2.GetResponse:
        record = await ops.transfer_record(self.engine, request.id, ops.check_wait(request.wait),
                                           ops.check_appear(request.appear))
        return transfers_pb2.GetResponse(transfer=convert.transfer_message(record))

    @translated
    async def Cancel(self, request: transfers_pb2.CancelRequest, context: Any) -> transfers_pb2.CancelResponse:
        record = await ops.cancel_transfer(self.engine, request.id)
        return transfers_pb2.CancelResponse(transfer=convert.transfer_message(record))

    @translated
    async def SubmitAndWatch(self, request: transfers_pb2.SubmitAndWatchRequest, context: Any
                             ) -> AsyncIterator[transfers_pb2.SubmitAndWatchResponse]:
        """The end awaited on the transfer itself, not through the hub: it wakes this call as it
        wakes a long-polling REST submit, before the table's listeners run."""
        t, wait = self._start(request.submit)
        started = t.public()
        yield transfers_pb2.SubmitAndWatchResponse(kind=transfers_pb2.EVENT_KIND_SNAPSHOT,
                                                   transfer=convert.transfer_message(started))
        if started["state"] not in TERMINAL and await t.wait(wait):
            yield transfers_pb2.SubmitAndWatchResponse(kind=transfers_pb2.EVENT_KIND_CHANGED,
                                                       transfer=convert.transfer_message(t.public()))

    @translated
    async def Watch(self, request: transfers_pb2.WatchRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[transfers_pb2.WatchResponse]:
        appear = ops.check_appear(request.appear)
        if len(request.ids) == 1 and request.follow:  # one transfer: awaited on itself, not through the hub
            with self.hub.held():
                async for message in self._watch_one(request.ids[0], appear):
                    yield message
            return
        watcher = self.hub.subscribe(list(request.ids), request.submitter, request.follow, request.since)
        # ids not here yet, and until when they may come (then the stream ends NOT_FOUND)
        absent = {i for i in request.ids if self.engine.transfers.find(i) is None} if appear else set()
        until = asyncio.get_running_loop().time() + appear
        try:
            while True:
                if watcher.closed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the sidecar is shutting down: watch again")
                if watcher.overflowed:
                    raise Overloaded("this watcher fell too far behind: watch again for the current states")
                for event in watcher.drain():
                    if event.kind == "not_found" and event.id in absent:
                        continue  # awaited for ``appear`` seconds, not reported yet
                    absent.discard(event.id)
                    message = transfers_pb2.WatchResponse(kind=EVENT_KINDS[event.kind])
                    if event.record is None:
                        message.transfer.id = event.id
                    else:
                        message.transfer.CopyFrom(convert.transfer_message(event.record))
                    yield message
                if watcher.finished and not absent:
                    return
                if not watcher.unread:
                    left = until - asyncio.get_running_loop().time()
                    if absent and left <= 0:
                        raise NotFound(f"no transfer {sorted(absent)[0]} (none came within {appear:g} s)")
                    try:  # not wait_for: it can lose the cancellation of a client that went away
                        async with asyncio.timeout(min(HEARTBEAT, left) if absent else HEARTBEAT):
                            await watcher.wake.wait()
                    except TimeoutError:
                        pass
        finally:
            self.hub.unsubscribe(watcher)


    async def _watch_one(self, transfer_id: str, appear: float) -> AsyncIterator[transfers_pb2.WatchResponse]:
        """A followed Watch of one transfer, as the hub's would send it (its state, then its end),
        awaited on the transfer itself: its end wakes this call as it wakes a long-polling GET,
        before the table's listeners (and the hub) run, the DONE to its sender sent first."""
        table = self.engine.transfers
        t = table.find(transfer_id)
        if t is None and appear:
            t = await table.arrival(transfer_id, appear)
            if t is None:
                raise NotFound(f"no transfer {transfer_id} (none came within {appear:g} s)")
        if t is None:
            yield self._event("not_found", transfer_id, None)
            while t is None:
                t = await table.arrival(transfer_id, HEARTBEAT)
        yield self._event("snapshot", transfer_id, t.public())
        while not t.state.terminal:
            if await t.wait(HEARTBEAT):
                yield self._event("changed", transfer_id, t.public())
        while True:  # followed: the stream stays open until the client ends it
            await asyncio.sleep(HEARTBEAT)

    @staticmethod
    def _event(kind: str, transfer_id: str, record: dict[str, Any] | None) -> transfers_pb2.WatchResponse:
        message = transfers_pb2.WatchResponse(kind=EVENT_KINDS[kind])
        if record is None:
            message.transfer.id = transfer_id
        else:
            message.transfer.CopyFrom(convert.transfer_message(record))
        return message


class Codebooks(codebooks_pb2_grpc.CodebooksServiceServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    @translated
    async def PutCodebook(self, request: codebooks_pb2.PutCodebookRequest, context: Any
                          ) -> codebooks_pb2.PutCodebookResponse:
        stored = ops.put_codebook(self.engine, request.name, request.codec or "splitzip", request.document)
        return codebooks_pb2.PutCodebookResponse(codebook=codebooks_pb2.Codebook(**stored))

    @translated
    async def GetCodebook(self, request: codebooks_pb2.GetCodebookRequest, context: Any
                          ) -> codebooks_pb2.GetCodebookResponse:
        return codebooks_pb2.GetCodebookResponse(document=self.engine.codebook_json(request.name))

    @translated
    async def Calibrate(self, request: codebooks_pb2.CalibrateRequest, context: Any
                        ) -> codebooks_pb2.CalibrateResponse:
        try:
            options = json.loads(request.options_json) if request.options_json else {}
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise BadRequest(f"options_json: {exc}") from None
        body = CalibrateBody.model_validate({
            "region": request.region, "blocks": convert.blocks_form(request.blocks),
            "codec": request.codec or "splitzip", "token_axis": _optional(request, "token_axis"), "options": options})
        book = await ops.calibrate(self.engine, request.name, body)
        return codebooks_pb2.CalibrateResponse(codebook=codebooks_pb2.Codebook(**book))


class Health(health_pb2_grpc.HealthServiceServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    @translated
    async def GetHealth(self, request: health_pb2.GetHealthRequest, context: Any) -> health_pb2.GetHealthResponse:
        return health_pb2.GetHealthResponse(**ops.health(self.engine))
