"""Small host transfers go inline, without a task on either side (two real engines over TCP on
loopback, in one process): they end exactly once, whatever ends them, and free their regions."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import torch

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, State, TransferSpec
from kvferry.engine.blocks import Range


@contextlib.asynccontextmanager
async def _engines(transfer_timeout: float = 5):
    """Two started engines on the CPU over TCP on loopback, closed after."""
    engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=transfer_timeout))
               for _ in range(2)]
    for e in engines:
        await e.start()
    try:
        yield engines
    finally:
        for e in engines:
            await e.close()


def _run(body):
    async def main():
        async with _engines() as (a, b):
            src = await a.register_region(RegionSpec("src", 4, (64,), "bfloat16"))
            src.tensor.copy_(torch.randn(4, 64).to(torch.bfloat16))
            await b.register_region(RegionSpec("dst", 4, (64,), "bfloat16"))
            await body(a, b)

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


def test_an_ended_transfer_keeps_its_record_not_its_block_lists():
    """The history holds thousands of ended transfers: each keeps what ``GET /v1/transfers`` shows,
    not the spec it was started from (its block lists), inline or streamed."""
    async def body(a, b):
        for blocks in ([0], [0, 1, 2, 3]):
            spec = _spec(b, blocks, blocks)
            t = a.submit(spec)
            assert (await a.wait(t.id, 5))["state"] == "done"
            gone = weakref.ref(spec)
            del spec
            gc.collect()
            assert gone() is None, gc.get_referrers(gone())
            assert a.transfers.get(t.id).public()["blocks"] == len(blocks)

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
    ``RELEARN_SECONDS``, and after that a thread relearns it while the transfer goes on with the
    old one; the frames exact throughout."""
    from kvferry import codec
    from kvferry.engine import codebooks as codebooks_module

    async def body(a, b):
        seen = []
        learn = type(codec.get("splitzip")).learn

        def counting(self, sample, layout=None):
            seen.append((sample.shape[0], layout))
            return learn(self, sample, layout)

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
            assert seen == [(3, None)]  # once, on the transfer's blocks (3 fit a chunk)
            await send([2, 0], [1, 3])
            await a.learned()
            assert seen == [(3, None)]  # the region's codebook, learned a moment ago
            monkeypatch.setattr(codebooks_module, "RELEARN_SECONDS", -1.0)
            first = a.regions.get("src").learned["splitzip"]
            await send([2, 0], [1, 3])
            await a.learned()
            assert seen == [(3, None), (2, None)]
            assert a.regions.get("src").learned["splitzip"][1] > first[1]
        finally:
            type(codec.get("splitzip")).learn = learn

    _run(body)


def test_a_region_with_named_axes_learns_entropy_contexts_per_position_in_a_thread():
    """The first transfer learns a channel codebook at once; a thread then learns one with the
    region's token axis (contexts: every other position of the block), which the next transfer
    uses; both exact."""
    import threading

    from kvferry import codec

    async def main():
        async with _engines(transfer_timeout=5) as (a, b):
            shape = (2, 2, 4, 64)  # layer, kv, token, channel
            src = await a.register_region(RegionSpec("src", 8, shape, "bfloat16",
                                                     axes=("layer", "kv", "token", "channel")))
            scale = torch.logspace(-3, 2, 2 * 2 * 64).view(2, 2, 1, 64)  # every (layer, kv, channel) its own
            src.tensor.copy_((torch.randn(8, *shape) * scale).to(torch.bfloat16))
            dst = await b.register_region(RegionSpec("dst", 8, shape, "bfloat16"))

            async def send(ids):
                spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(ids),
                                    dst_blocks=Blocks.of(ids[::-1]), codec="entropy")
                record = await a.wait(a.submit(spec).id, 10)
                assert record["state"] == "done"
                assert torch.equal(dst.tensor[ids[::-1]].view(torch.int16), src.tensor[ids].view(torch.int16))
                return record

            learn = type(codec.get("entropy")).learn
            gate = threading.Event()

            def gated(self, sample, layout=None):  # the thread's learning waits for the test
                if threading.current_thread() is not threading.main_thread():
                    gate.wait(10)
                return learn(self, sample, layout)

            type(codec.get("entropy")).learn = gated
            try:
                await send([0, 1])
                quick = src.learned["entropy"]
                assert quick[0].geometry.contexts == 64 and not quick[2]  # channels, the layout still to come
                assert not src.describe()["learned"]["entropy"]["settled"]
            finally:
                gate.set()
                type(codec.get("entropy")).learn = learn
            await a.learned()
            assert src.learned["entropy"][2] and src.learned["entropy"][3] == 2
            await send([0, 1, 2, 3, 4, 5, 6, 7])  # four times the blocks: relearned from them
            await a.learned()
            book, _, final, blocks = src.learned["entropy"]
            assert final and blocks == 8
            assert book.geometry.period == 2 * 2 * 4 * 64 and book.geometry.contexts == 2 * 2 * 64
            await send([4, 5, 6, 7, 0, 1, 2, 3])
            assert src.learned["entropy"][0] is book  # used, not relearned
            await send([0])  # a transfer of fewer blocks does not relearn
            assert src.learned["entropy"][0] is book and not a.learner.active
            described = src.describe()["learned"]["entropy"]
            assert described["settled"] and described["blocks"] == 8

    asyncio.run(main())


def test_a_transfer_with_more_blocks_while_a_codebook_is_learned_queues_its_sample():
    """A relearn in a thread that a transfer with four times its blocks overtakes learns from
    that transfer's blocks next; the region stays unsettled until then."""
    import threading

    from kvferry import codec

    async def body(a, b):
        gate, seen = threading.Event(), []
        learn = type(codec.get("splitzip")).learn

        def gated(self, sample, layout=None):
            if threading.current_thread() is not threading.main_thread():  # the engine's relearning
                gate.wait(10)
            seen.append(sample.shape[0])
            return learn(self, sample, layout)

        async def send(ids):
            spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(ids),
                                dst_blocks=Blocks.of(ids), codec="splitzip")
            assert (await a.wait(a.submit(spec).id, 5))["state"] == "done"

        type(codec.get("splitzip")).learn = gated
        try:
            src = a.regions.get("src")
            src.learned["splitzip"] = (learn(codec.get("splitzip"), src.tensor[:1]), 0.0, True, 1)
            from kvferry.engine import codebooks as codebooks_module
            codebooks_module.RELEARN_SECONDS, saved = -1.0, codebooks_module.RELEARN_SECONDS
            try:
                await send([0])  # stale: relearned from one block, held at the gate
            finally:
                codebooks_module.RELEARN_SECONDS = saved
            assert not src.describe()["learned"]["splitzip"]["settled"]
            await send([0, 1, 2, 3])  # four times as many: queued behind it
            gate.set()
            await a.learned()
            assert seen == [1, 4]
            entry = src.describe()["learned"]["splitzip"]
            assert entry["settled"] and entry["blocks"] == 4
        finally:
            type(codec.get("splitzip")).learn = learn

    _run(body)


def test_a_transfer_with_a_newly_learned_codebook_is_no_speed_for_auto(monkeypatch):
    """``auto`` goes by measured transfer speeds; a transfer that uses a codebook for the first
    time (built its tables) is not one, nor is a codec's first transfer to a peer."""
    from kvferry.engine import codebooks as codebooks_module

    async def main():
        async with _engines(transfer_timeout=10) as (a, b):
            shape = (16, 1024)  # 32 KiB blocks: 64 of them make a measured (>= 1 MiB) transfer
            src = await a.register_region(RegionSpec("src", 64, shape, "bfloat16"))
            src.tensor.copy_((torch.randn(64, *shape) * 0.05).to(torch.bfloat16))
            await b.register_region(RegionSpec("dst", 64, shape, "bfloat16"))
            key = (b.data_address, "splitzip", (64 * 32 << 10).bit_length())

            async def send():
                spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(range(64)),
                                    dst_blocks=Blocks.of(range(63, -1, -1)), codec="splitzip")
                assert (await a.wait(a.submit(spec).id, 10))["state"] == "done"
                return a.policy.measured.get(key)

            assert await send() is None  # the first: learned its codebook, built kernels
            await a.learned()
            measured = await send()
            assert measured is not None  # the same codebook again: a speed
            monkeypatch.setattr(codebooks_module, "RELEARN_SECONDS", -1.0)
            assert await send() != measured  # relearning in a thread; this one still used the old book
            measured = a.policy.measured[key]
            await a.learned()
            assert await send() == measured  # the relearned codebook's first use: not a speed

    asyncio.run(main())


def test_a_codebook_calibrated_on_a_region_without_axis_names_fits_one_block():
    """``calibrate_codebook`` with a token axis on a region whose axes are not named: the blocks
    are the samples (an entropy period of one block), not their stack; transfers with it exact."""
    from kvferry.codec import entropy

    async def main():
        async with _engines(transfer_timeout=10) as (a, b):
            shape = (2, 8, 32)  # kv, token, channel
            src = await a.register_region(RegionSpec("src", 6, shape, "bfloat16"))
            scale = torch.logspace(-3, 2, 2 * 32).view(2, 1, 32)
            src.tensor.copy_((torch.randn(6, *shape) * scale).to(torch.bfloat16))
            dst = await b.register_region(RegionSpec("dst", 6, shape, "bfloat16"))
            await a.calibrate_codebook("kv", "entropy", "src", [0, 1, 2, 3], token_axis=1, options={"tables": 6})
            book = a.codebooks.named["kv"][1]
            assert book.geometry == entropy.Geometry(2, 8, 32)
            assert book.to_json() == entropy.calibrate_blocks(src.tensor[:4], token_axis=1, tables=6).to_json()
            b.codebooks.named["kv"] = a.codebooks.named["kv"]
            spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of([5, 4]),
                                dst_blocks=Blocks.of([0, 1]), codec="entropy", codebook="kv")
            assert (await a.wait(a.submit(spec).id, 10))["state"] == "done"
            assert torch.equal(dst.tensor[[0, 1]].view(torch.int16), src.tensor[[5, 4]].view(torch.int16))

    asyncio.run(main())
