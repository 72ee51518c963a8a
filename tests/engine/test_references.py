"""Regions of predictor KV named as references: one that is being deleted or quarantined is
refused (its values may no longer be the ones the peer codes against), and a transfer of many
pairs checks its block list against a reference once per region size, not once per pair (an
announce of a thousand pairs would otherwise cost seconds of the event loop)."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, TransferSpec
from kvferry.engine.blocks import Range
from kvferry.engine.errors import BadRequest, Conflict

BLOCKS = 4096


def _run(body):
    async def main():
        engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp"))
        await engine.start()
        try:
            for name in ("src", "ref"):
                await engine.register_region(RegionSpec(name, BLOCKS, (16,), "bfloat16"))
            await body(engine)
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def _spec(engine: Engine, pairs: int) -> TransferSpec:
    every = Blocks(ranges=(Range(0, BLOCKS, 1),))
    return TransferSpec(peer="127.0.0.1:9", pairs=(("src", "dst"),) * pairs, src_blocks=every, dst_blocks=every,
                        codec="predictive", references=(("ref", "dst-ref"),) * pairs)


def test_a_reference_being_deleted_or_quarantined_is_refused():
    async def body(engine):
        ref = engine.regions.get("ref")
        ref.deleting += 1  # a delete under way, waiting for a sender to give a lease back
        with pytest.raises(Conflict, match="being deleted or quarantined"):
            engine.submit(_spec(engine, 1))
        ref.deleting -= 1
        ref.quarantined = "a sender did not confirm giving its lease back"
        with pytest.raises(Conflict, match="being deleted or quarantined"):
            engine.submit(_spec(engine, 1))

    _run(body)


def test_many_pairs_check_their_blocks_against_a_reference_once(monkeypatch):
    async def body(engine):
        resolved = []
        resolve = Blocks.resolve
        monkeypatch.setattr(Blocks, "resolve", lambda self, n, *rest: resolved.append(n) or resolve(self, n, *rest))
        with pytest.raises(BadRequest, match="codebook"):  # refused after its references were checked
            engine.submit(_spec(engine, 256))
        assert len(resolved) == 1, len(resolved)  # one region size: the sources' check stands for all

    _run(body)
