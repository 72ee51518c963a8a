"""What only the gRPC front end has: status codes on the wire, the standard health and reflection
services, and Watch (pushed events, resynced across a sidecar restart)."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvferry.client.grpc import GrpcClient, GrpcSender
from kvferry.engine import errors
from kvferry.demo import free_port
from kvferry.proto.v1 import regions_pb2, regions_pb2_grpc, transfers_pb2, transfers_pb2_grpc
from tests.api.conftest import spawn_sidecar
from tests.engine.conftest import TOKEN, stop

pytestmark = pytest.mark.slow
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _name() -> str:
    return f"g{uuid.uuid4().hex[:10]}"


def _run(scenario, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout))


async def _code(call) -> tuple[grpc.StatusCode, dict]:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call
    return failed.value.code(), dict(failed.value.trailing_metadata() or ())


def test_errors_are_mapped_status_codes(sidecars):
    a, _ = sidecars

    async def scenario():
        async with grpc.aio.insecure_channel(a.grpc) as channel:
            regions = regions_pb2_grpc.RegionsServiceStub(channel)
            transfers = transfers_pb2_grpc.TransfersServiceStub(channel)
            code, meta = await _code(transfers.Get(transfers_pb2.GetRequest(id="nope"), metadata=AUTH, timeout=5))
            assert code == grpc.StatusCode.NOT_FOUND and meta["kvferry-error"] == "NotFound"
            code, meta = await _code(transfers.Submit(transfers_pb2.SubmitRequest(), metadata=AUTH, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and meta["kvferry-error"] == "BadRequest"
            code, _ = await _code(transfers.Get(transfers_pb2.GetRequest(id="x", wait=float("nan")), metadata=AUTH,
                                                timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            name = _name()
            create = regions_pb2.CreateRegionRequest(name=name, num_blocks=2, block_shape=[4], dtype="bfloat16")
            await regions.CreateRegion(create, metadata=AUTH, timeout=5)
            code, meta = await _code(regions.CreateRegion(create, metadata=AUTH, timeout=5))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and meta["kvferry-error"] == "Conflict"
            code, meta = await _code(regions.PutBlocks(regions_pb2.PutBlocksRequest(name=name, start=0, count=1,
                                                                                    data=b"short"),
                                                       metadata=AUTH, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            code, meta = await _code(regions.ListRegions(regions_pb2.ListRegionsRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED and meta["kvferry-error"] == "Unauthorized"
            code, _ = await _code(transfers.Watch(transfers_pb2.WatchRequest(), timeout=5).read())
            assert code == grpc.StatusCode.UNAUTHENTICATED
            code, _ = await _code(regions.GetBlock(regions_pb2.GetBlockRequest(name=name, index=2), metadata=AUTH,
                                                   timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT  # InvalidBlocks, a BadRequest

    _run(scenario)


def test_health_and_reflection_answer_without_the_token(sidecars):
    a, _ = sidecars

    async def scenario():
        async with grpc.aio.insecure_channel(a.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvferry.v1.TransfersService"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = [r async for r in reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
            names = {s.name for s in answers[0].list_services_response.service}
            assert {"kvferry.v1.RegionsService", "kvferry.v1.TransfersService", "kvferry.v1.CodebooksService",
                    "kvferry.v1.HealthService", "grpc.health.v1.Health"} <= names
        async with GrpcClient(a.grpc, token=TOKEN) as client:
            assert (await client.health())["data_address"] == a.data

    _run(scenario)


async def _regions(client: GrpcClient, receiver: GrpcClient, blocks: int, shape=(512, 256)) -> tuple[str, str]:
    src, dst = _name(), _name()
    await client.create_region(src, blocks, shape, "bfloat16")
    await receiver.create_region(dst, blocks, shape, "bfloat16")
    return src, dst


def test_watch_sends_the_current_state_then_each_change(sidecars):
    a, b = sidecars

    async def scenario():
        async with GrpcClient(a.grpc, token=TOKEN) as client, GrpcClient(b.grpc, token=TOKEN) as receiver:
            src, dst = await _regions(client, receiver, 8)  # 2 MiB on a 10 MB/s link: running when watched
            done = await client.start(src, [0], b.data, dst, [0], codec="raw")
            await done.wait(timeout=30)
            slow = await client.start(src, range(8), b.data, dst, range(8), codec="raw")
            events = [e async for e in client.watch([done.id, slow.id, "unknown-id"])]
            first = {e.id: e for e in events[:3]}
            assert {e.kind for e in events[:3]} == {"snapshot", "not_found"}
            assert first[done.id].status.state == "done" and first["unknown-id"].status is None
            assert first[slow.id].status.state in ("queued", "running")
            assert (events[-1].kind, events[-1].id, events[-1].status.state) == ("changed", slow.id, "done")
            mine = await client.start(src, range(8), b.data, dst, range(8), codec="raw")
            states = [(e.id, e.status.state) async for e in client.watch(mine=True)]  # ends once all ended
            assert states[-1] == (mine.id, "done") and {i for i, _ in states} == {mine.id}
            other = GrpcClient(a.grpc, token=TOKEN)
            try:
                assert [e async for e in other.watch(mine=True)] == []  # another client's: nothing in progress
            finally:
                await other.aclose()

    _run(scenario)


def test_submit_and_watch_streams_the_start_then_the_end(sidecars):
    """One stream per transfer: its record once started, then at its end, read by the blocking
    client on its own thread; refusals end the call with the mapped status, as Submit's do."""
    a, b = sidecars

    async def regions() -> tuple[str, str]:
        async with GrpcClient(a.grpc, token=TOKEN) as client, GrpcClient(b.grpc, token=TOKEN) as receiver:
            return await _regions(client, receiver, 8)

    src, dst = asyncio.run(regions())
    with GrpcSender(a.grpc, token=TOKEN, timeout=30) as sender:
        watched = sender.start(src, range(8), b.data, dst, range(8), codec="raw", wait=60)  # ~0.2 s on the slow link
        assert watched.record["state"] in ("queued", "running") and watched.id
        end = watched.end()
        assert end["id"] == watched.id and end["state"] == "done" and end["blocks_done"] == 8
        assert sender.send(src, [0], b.data, dst, [1], codec="raw", wait=60)["state"] == "done"
        with pytest.raises(errors.NotFound):
            sender.start("no-such-region", [0], b.data, dst, [0], wait=5)
        with pytest.raises(errors.BadRequest):
            sender.start(src, [0], b.data, dst, [0], wait=301)  # a wait is at most 300 s
    with GrpcSender(a.grpc, timeout=5) as stranger:
        with pytest.raises(errors.Unauthorized):
            stranger.start(src, [0], b.data, dst, [0], wait=5)


def test_the_receiver_watches_a_transfer_before_and_after_it_arrives(sidecars):
    """The receiver's sidecar: ``GrpcSender.ended`` reads the end of a transfer a peer is about to
    announce from a Watch of it (one that never comes is NotFound after ``appear``), and Get with
    ``appear`` waits for it as REST's long-poll does."""
    a, b = sidecars

    async def regions() -> tuple[str, str]:
        async with GrpcClient(a.grpc, token=TOKEN) as client, GrpcClient(b.grpc, token=TOKEN) as receiver:
            return await _regions(client, receiver, 8)

    src, dst = asyncio.run(regions())
    with GrpcSender(a.grpc, token=TOKEN, timeout=30) as sender, GrpcSender(b.grpc, token=TOKEN, timeout=30) as mine:
        started = sender.send(src, range(8), b.data, dst, range(8), codec="raw", wait=0)
        end = mine.ended(started["id"], wait=60, appear=5)
        assert end["id"] == started["id"] and end["state"] == "done" and end["direction"] == "in"
        assert mine.ended(started["id"], wait=5, appear=1)["state"] == "done"  # ended already: at once
        with pytest.raises(errors.NotFound, match="none came within 0.3 s"):
            mine.ended(uuid.uuid4().hex, wait=30, appear=0.3)
        with pytest.raises(errors.BadRequest, match="appear"):
            mine.ended(uuid.uuid4().hex, wait=30, appear=6)

    async def get() -> None:
        async with GrpcClient(b.grpc, token=TOKEN) as receiver:
            with pytest.raises(errors.NotFound):
                await receiver.transfer(uuid.uuid4().hex, wait=5, appear=0.2)
            assert (await receiver.transfer(started["id"], wait=5, appear=1))["state"] == "done"

    _run(get)


def test_a_watch_outlives_a_sidecar_restart(sidecars):
    """The client's watch re-dials the restarted sidecar and resubscribes: it learns that the old
    transfer is gone and sees the new sidecar's transfers, in one iteration."""
    _, b = sidecars
    grpc_port = free_port()
    a = spawn_sidecar(grpc_port=grpc_port)

    async def scenario():
        nonlocal a
        async with GrpcClient(a.grpc, token=TOKEN) as client, GrpcClient(b.grpc, token=TOKEN) as receiver:
            src, dst = await _regions(client, receiver, 1, (4, 8))
            old = await client.start(src, [0], b.data, dst, [0])
            await old.wait(timeout=30)
            by_id: asyncio.Queue = asyncio.Queue()
            everything: asyncio.Queue = asyncio.Queue()

            async def collect(queue: asyncio.Queue, **how) -> None:
                async for event in client.watch(follow=True, reconnect_timeout=60, **how):
                    await queue.put(event)

            tasks = [asyncio.create_task(collect(by_id, ids=[old.id])),
                     asyncio.create_task(collect(everything))]
            try:
                assert (await asyncio.wait_for(by_id.get(), 10)).status.state == "done"
                stop(a.daemon)
                a = await asyncio.to_thread(spawn_sidecar, None, grpc_port)
                gone = await asyncio.wait_for(by_id.get(), 30)
                assert (gone.kind, gone.id) == ("not_found", old.id)
                await client.create_region(src, 1, (4, 8), "bfloat16")
                new = await client.start(src, [0], b.data, dst, [0])
                seen = []
                while not seen or seen[-1] != (new.id, "done"):
                    event = await asyncio.wait_for(everything.get(), 30)
                    seen.append((event.id, event.status.state))
                assert seen[0][0] == new.id
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    try:
        _run(scenario, 120)
    finally:
        stop(a.daemon)


def test_codebooks_are_calibrated_stored_and_read(sidecars):
    a, _ = sidecars

    async def scenario():
        async with GrpcClient(a.grpc, token=TOKEN) as client:
            import torch

            name, book = _name(), _name()
            kv = torch.randn(4, 2, 8, 64).to(torch.bfloat16)
            await client.create_region(name, 4, [2, 8, 64], "bfloat16")
            await client.put_blocks(name, 0, 4, kv.view(torch.uint8).numpy().tobytes())
            made = await client.calibrate(book, name, range(4))
            assert made["name"] == book and made["codec"] == "splitzip" and made["digest"]
            document = await client.codebook(book)
            copy = await client.put_codebook(_name(), document)
            assert copy["digest"] == made["digest"]
            with pytest.raises(errors.NotFound):
                await client.codebook("no-such-codebook")
            with pytest.raises(errors.BadRequest):
                await client.calibrate(_name(), name, range(4), energy="lots")

    _run(scenario)
