"""The same behaviour over both front ends: each test runs once with the REST client
(``AsyncClient``) and once with the gRPC one (``GrpcClient``), against the same real sidecars."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from kvferry.client import AsyncTransfer, TransferFailed
from kvferry.engine import errors

pytestmark = pytest.mark.slow


def _name() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


def _run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _pair(a, b, blocks: int, shape=(2, 8, 64)) -> tuple[str, str, torch.Tensor]:
    """An owned source region on ``a`` holding random KV, and an empty destination on ``b``."""
    src, dst = _name(), _name()
    kv = torch.randn(blocks, *shape).to(torch.bfloat16)
    await a.create_region(src, blocks, shape, "bfloat16")
    await a.put_blocks(src, 0, blocks, kv.view(torch.uint8).numpy().tobytes())
    await b.create_region(dst, blocks, shape, "bfloat16")
    return src, dst, kv


def test_regions_are_created_read_listed_and_deleted(sidecars, front):
    a, _ = sidecars

    async def scenario():
        async with a.client(front) as client:
            name = _name()
            made = await client.create_region(name, 4, [2, 8], "float16", axes=["kv", "channel"])
            assert (made["name"], made["num_blocks"], made["block_bytes"], made["axes"]) == (name, 4, 32, ["kv", "channel"])
            assert (await client.region(name))["block_shape"] == [2, 8]
            assert name in [r["name"] for r in await client.list_regions()]
            await client.put_blocks(name, 1, 1, bytes(range(32)))
            assert await client.get_block(name, 1) == bytes(range(32))
            with pytest.raises(errors.Conflict):
                await client.create_region(name, 4, [2, 8], "float16")
            await client.delete_region(name)
            with pytest.raises(errors.NotFound):
                await client.region(name)

    _run(scenario)


def test_a_transfer_is_submitted_waited_for_and_read(sidecars, front):
    a, b = sidecars

    async def scenario():
        async with a.client(front) as sender, b.client(front) as receiver:
            src, dst, kv = await _pair(sender, receiver, 4)
            t = await sender.start(src, [0, 1, 2, 3], b.data, dst, [3, 2, 1, 0], codec="raw")
            assert isinstance(t, AsyncTransfer) and t.status.state in ("queued", "running", "done")
            status = await t.wait(timeout=30)
            assert status.ok and t.done and status.bytes_raw == kv.numel() * 2 and status.chosen_codec == "raw"
            assert await receiver.get_block(dst, 3) == kv[0].view(torch.uint8).numpy().tobytes()
            record = await sender.transfer(t.id)
            assert record["state"] == "done" and record["regions"] == [{"src": src, "dst": dst}]
            assert (await receiver.transfer(t.id))["direction"] == "in"
            same = await sender.submit(src, range(2), b.data, dst, range(2), wait=30)
            assert (await sender.wait(same))["state"] == "done"
            with pytest.raises(errors.Conflict):  # it has ended
                await t.cancel()

    _run(scenario)


def test_a_running_transfer_is_cancelled(sidecars, front):
    a, b = sidecars

    async def scenario():
        async with a.client(front) as sender, b.client(front) as receiver:
            src, dst, _ = await _pair(sender, receiver, 16, (512, 256))  # 4 MiB on a 10 MB/s link
            t = await sender.start(src, range(16), b.data, dst, range(16), codec="raw")
            cancelled = await t.cancel()
            assert cancelled.state == "cancelled" and t.done and t.status.error_kind == "Cancelled"
            with pytest.raises(TransferFailed) as failed:
                await t.wait(timeout=10)
            assert failed.value.state == "cancelled"

    _run(scenario)


async def _arrived(client, transfer_id: str) -> None:
    for _ in range(1000):
        try:
            if (await client.transfer(transfer_id))["state"] == "running":
                return
        except errors.NotFound:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError(f"transfer {transfer_id} never ran at the receiver")


def test_a_draining_delete_waits_for_the_transfer_in_progress_and_refuses_new_ones(sidecars, front):
    a, b = sidecars

    async def scenario():
        async with a.client(front) as sender, b.client(front) as receiver:
            src, dst, kv = await _pair(sender, receiver, 16, (512, 256))  # 4 MiB on a 10 MB/s link
            t = await sender.start(src, range(16), b.data, dst, range(16), codec="raw")
            await _arrived(receiver, t.id)  # a delete knows only of the transfers its sidecar has
            for bad in (-1, 301):
                with pytest.raises(errors.BadRequest):
                    await receiver.delete_region(dst, drain=bad)
            delete = asyncio.ensure_future(receiver.delete_region(dst, drain=30))
            await asyncio.sleep(0.1)
            with pytest.raises(TransferFailed, match="being deleted"):
                await sender.submit(src, [0], b.data, dst, [0], wait=10)
            await delete
            assert (await t.wait(timeout=10)).ok
            with pytest.raises(errors.NotFound):
                await receiver.region(dst)

    _run(scenario)


def test_bad_input_is_refused_with_the_same_error(sidecars, front):
    a, b = sidecars

    async def scenario():
        async with a.client(front) as client:
            src, dst, _ = await _pair(client, client, 2)
            with pytest.raises(errors.NotFound):
                await client.transfer("no-such-transfer")
            with pytest.raises(errors.NotFound):
                await client.cancel("no-such-transfer")
            with pytest.raises(errors.BadRequest):  # 2 source blocks, 1 destination block
                await client.submit(src, [0, 1], b.data, dst, [0])
            with pytest.raises(errors.BadRequest):  # not host:port
                await client.submit(src, [0], "nowhere", dst, [0])
            with pytest.raises(errors.BadRequest):  # the wait is bounded
                await client.transfer("x", wait=301)
            with pytest.raises(errors.BadRequest):
                await client.create_region("bad name!", 1, [2], "bfloat16")
            with pytest.raises(errors.BadRequest):
                await client.create_region(_name(), 1, [2], "int8")
            with pytest.raises(errors.InvalidBlocks):  # beyond the region
                await client.submit(src, [7], b.data, dst, [0])
            assert len(await client.list_regions()) >= 2  # nothing was lost on the way

    _run(scenario)


def test_no_call_without_the_token(sidecars, front):
    a, _ = sidecars

    async def scenario():
        for token in (None, "wrong-token"):
            async with a.client(front, token=token) as client:
                with pytest.raises(errors.Unauthorized):
                    await client.list_regions()
                with pytest.raises(errors.Unauthorized):
                    await client.transfer("any")

    _run(scenario)
