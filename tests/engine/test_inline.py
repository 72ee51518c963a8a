"""Small host transfers go inline, without a task on either side (two real engines over TCP on
loopback, in one process): they end exactly once, whatever ends them, and free their regions."""

from __future__ import annotations

import asyncio

import torch

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, State, TransferSpec
from kvferry.engine.blocks import Range


def _run(body):
    async def main():
        engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=5))
                   for _ in range(2)]
        for e in engines:
            await e.start()
        try:
            a, b = engines
            src = await a.register_region(RegionSpec("src", 4, (64,), "bfloat16"))
            src.tensor.copy_(torch.randn(4, 64).to(torch.bfloat16))
            await b.register_region(RegionSpec("dst", 4, (64,), "bfloat16"))
            await body(a, b)
        finally:
            for e in engines:
                await e.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def _spec(b: Engine, src: list[int], dst: Blocks | list[int]) -> TransferSpec:
    return TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(src),
                        dst_blocks=Blocks.of(dst), codec="raw")


def test_inline_transfers_are_task_free_and_exact():
    async def body(a, b):
        for i in range(20):
            t = a.submit(_spec(b, [i % 4], [(i + 1) % 4]))
            if i:  # the first one opens the pooled connection (task path); the rest go inline
                assert t.task is None and t.state == State.RUNNING
            record = await a.wait(t.id, 5)
            assert record["state"] == "done"
            assert torch.equal(b.regions.get("dst").tensor[(i + 1) % 4].view(torch.int16),
                               a.regions.get("src").tensor[i % 4].view(torch.int16))
        assert not a.links and not b.links and not a.transfers.active() and not b.transfers.active()
        await a.delete_region("src")  # nothing holds it
        await b.delete_region("dst")

    _run(body)


def test_an_announce_that_cannot_be_packed_fails_the_transfer_and_frees_the_region():
    """A destination range outside the wire's fields is the transfer's failure: not an exception
    out of submit that leaves it running and its region busy forever."""
    async def body(a, b):
        assert (await a.wait(a.submit(_spec(b, [0], [1])).id, 5))["state"] == "done"  # pool warm
        t = a.submit(_spec(b, [0], Blocks(ranges=(Range(2 ** 32, 1),))))
        assert t.state == State.FAILED and "ProtocolViolation" in (t.error_kind or "")
        assert not a.links and a.transfers.active() == []
        await a.delete_region("src")

    _run(body)


def test_a_codec_learns_its_codebook_once_and_relearns_it_after_a_while(monkeypatch):
    """SplitZip without a named codebook: learned from the first blocks of the transfer and bound
    to every chunk (not recalibrated per chunk); the region's next transfers reuse it within
    ``RELEARN_SECONDS`` and learn again after; the frames exact throughout."""
    from kvferry import codec
    from kvferry.engine import engine as engine_module

    async def body(a, b):
        seen = []
        learn = type(codec.get("splitzip")).learn

        def counting(self, sample):
            seen.append(sample.shape[0])
            return learn(self, sample)

        async def send(src, dst):
            spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(src),
                                dst_blocks=Blocks.of(dst), codec="splitzip")
            record = await a.wait(a.submit(spec).id, 5)
            assert record["state"] == "done"
            assert torch.equal(b.regions.get("dst").tensor[dst].view(torch.int16),
                               a.regions.get("src").tensor[src].view(torch.int16))

        type(codec.get("splitzip")).learn = counting
        try:
            await send([3, 1, 0], [0, 2, 3])
            assert seen == [3]  # once, on the transfer's blocks (3 fit a chunk)
            await send([2, 0], [1, 3])
            assert seen == [3]  # the region's codebook, learned a moment ago
            monkeypatch.setattr(engine_module, "RELEARN_SECONDS", -1.0)
            await send([2, 0], [1, 3])
            assert seen == [3, 2]
        finally:
            type(codec.get("splitzip")).learn = learn

    _run(body)
