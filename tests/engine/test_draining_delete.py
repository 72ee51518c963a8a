"""A draining delete (``drain`` seconds): a worker shutting down under traffic deletes its region
in one call. New transfers that would use the region are refused at once, on either side; those in
progress end as they would have; then the region goes. A drain that runs out leaves the region
registered and taking transfers again. Two real engines over TCP on loopback, in one process, on a
slow emulated link so that a transfer is in progress while the delete waits."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, TransferSpec
from kvferry.engine.errors import Conflict, NotFound, TransferFailed

BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 400  # 6.25 MiB: over a second on a link paced at 5 MB/s (``emulated_link_gbps``: GB/s)


def _run(body):
    async def main():
        engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=20,
                                   emulated_link_gbps=0.005)) for _ in range(2)]
        for e in engines:
            await e.start()
        try:
            a, b = engines
            src = await a.register_region(RegionSpec("src", BLOCKS, BLOCK, "bfloat16"))
            src.tensor.copy_(torch.randn(BLOCKS, *BLOCK).to(torch.bfloat16))
            await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16"))
            await body(a, b)
        finally:
            for e in engines:
                await e.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def _spec(b: Engine, ids: list[int]) -> TransferSpec:
    return TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(ids),
                        dst_blocks=Blocks.of(ids), codec="raw")


async def _in_progress(a: Engine, b: Engine) -> str:
    """A whole-region transfer, once the receiver has it running."""
    t = a.submit(_spec(b, list(range(BLOCKS))))
    for _ in range(2000):
        found = b.transfers.find(t.id)
        if found is not None and not found.state.terminal:
            return t.id
        await asyncio.sleep(0.002)
    raise AssertionError("the transfer never reached the receiver")


def _landed(a: Engine, b: Engine, ids: list[int]) -> bool:
    return torch.equal(b.regions.get("dst").tensor[ids], a.regions.get("src").tensor[ids])


def test_the_receivers_region_is_deleted_once_the_transfer_in_progress_is_done_and_takes_no_new_one():
    async def body(a, b):
        running = await _in_progress(a, b)
        delete = asyncio.ensure_future(b.delete_region("dst", drain=15))
        await asyncio.sleep(0.05)
        assert not delete.done()  # waiting for the running transfer
        with pytest.raises(TransferFailed, match="being deleted"):
            await a.wait(a.submit(_spec(b, [0])).id, 10)
        await delete
        assert (await a.wait(running, 1))["state"] == "done"
        assert b.transfers.get(running).state.value == "done"
        with pytest.raises(NotFound):
            b.regions.get("dst")

    _run(body)


def test_the_senders_region_is_deleted_once_its_transfer_is_done_and_no_new_one_reads_it():
    async def body(a, b):
        running = await _in_progress(a, b)
        delete = asyncio.ensure_future(a.delete_region("src", drain=15))
        await asyncio.sleep(0.05)
        with pytest.raises(Conflict, match="being deleted"):
            a.submit(_spec(b, [0]))
        source = a.regions.get("src").tensor.clone()
        await delete
        assert (await a.wait(running, 1))["state"] == "done"
        assert torch.equal(b.regions.get("dst").tensor, source)
        with pytest.raises(NotFound):
            a.regions.get("src")

    _run(body)


def test_a_drain_that_runs_out_leaves_the_region_taking_transfers():
    async def body(a, b):
        running = await _in_progress(a, b)
        with pytest.raises(Conflict, match="in use"):
            await b.delete_region("dst", drain=0.2)
        assert (await a.wait(running, 15))["state"] == "done"
        ids = [3, 1, 4]
        again = await a.wait(a.submit(_spec(b, ids)).id, 15)
        assert again["state"] == "done", again
        assert _landed(a, b, list(range(BLOCKS)))
        await b.delete_region("dst", drain=5)  # nothing in progress: at once
        with pytest.raises(NotFound):
            b.regions.get("dst")

    _run(body)


def test_a_second_delete_beside_a_draining_one_waits_its_turn_and_the_region_stays_closed():
    async def body(a, b):
        running = await _in_progress(a, b)
        draining = asyncio.ensure_future(b.delete_region("dst", drain=15))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(b.delete_region("dst"))  # no drain: it waits for the first to end
        await asyncio.sleep(0.05)
        assert not draining.done() and not second.done()
        with pytest.raises(TransferFailed, match="being deleted"):
            await a.wait(a.submit(_spec(b, [0])).id, 10)
        await draining
        with pytest.raises(NotFound):
            await second
        assert (await a.wait(running, 1))["state"] == "done"
        with pytest.raises(NotFound):
            b.regions.get("dst")

    _run(body)
