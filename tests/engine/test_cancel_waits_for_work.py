"""A cancel answers once nothing of the transfer writes into its regions any more. A receiver's
decode runs in a worker thread (or as GPU kernels) that cannot be stopped: a transfer cancelled
or failed mid-decode is terminal at once, while that decode still writes its blocks. A caller (the
vLLM connector) that gives the blocks to other work once its cancel answers must not have them
written after. Two real engines over TCP on loopback, in one process, the receiver's decode slowed
in its worker thread; and real sidecars over REST."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from kvferry.api import ops
from kvferry.engine import Blocks, Engine, RegionSpec, Settings, TransferSpec
from kvferry.engine.errors import Conflict, NotFound
from tests.engine.conftest import TOKEN, spawn, stop

BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 256  # 4 MiB, in chunks decoded in a worker thread
DECODE_S = 0.5


def _run(body):
    async def main():
        engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=10,
                                   chunk_bytes=1 << 20)) for _ in range(2)]
        for e in engines:
            await e.start()
        try:
            a, b = engines
            src = await a.register_region(RegionSpec("src", BLOCKS, BLOCK, "bfloat16"))
            src.tensor.copy_(torch.randn(BLOCKS, *BLOCK).to(torch.bfloat16))
            await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16"))
            await body(a, b, _slow_decodes(b))
        finally:
            for e in engines:
                await e.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def _slow_decodes(b: Engine) -> threading.Event:
    """Each of ``b``'s decodes in a worker thread takes ``DECODE_S`` longer; the event is set when
    the first one starts."""
    started, timed = threading.Event(), b.codec._timed

    def slow(direction, *args, **kwargs):
        if direction == "decode" and threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(DECODE_S)
        return timed(direction, *args, **kwargs)

    b.codec._timed = slow
    return started


async def _decoding(b: Engine, started: threading.Event, a: Engine) -> str:
    """The id of a transfer from ``a`` into ``b`` whose first chunk ``b`` is decoding now."""
    t = a.submit(TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(range(BLOCKS)),
                              dst_blocks=Blocks.of(range(BLOCKS)), codec="splitzip"))
    deadline = time.monotonic() + 10
    while not started.is_set():
        assert time.monotonic() < deadline, "the receiver never decoded"
        await asyncio.sleep(0.002)
    assert b.regions.get("dst").busy == {t.id}
    return t.id


def test_a_cancel_answers_once_the_decode_under_way_is_over():
    async def body(a, b, started):
        t_id = await _decoding(b, started, a)
        began = time.monotonic()
        record = await ops.cancel_transfer(b, t_id)
        assert record["state"] == "cancelled"
        assert not b.regions.get("dst").busy, "the cancel answered while its decode still wrote the blocks"
        assert time.monotonic() - began < DECODE_S + 5

    _run(body)


def test_a_cancel_of_a_transfer_that_failed_mid_decode_answers_once_the_decode_is_over():
    """The failure is the receiver's own (its connection lost, a deadline): the record is failed
    at once, the decode goes on; the cancel's Conflict comes once it is over."""
    async def body(a, b, started):
        t_id = await _decoding(b, started, a)
        t = b.transfers.get(t_id)
        b.driver.fail(t, "PeerError", "lost the peer")
        assert t.state.terminal and b.regions.get("dst").busy == {t_id}  # failed, still decoding
        with pytest.raises(Conflict):
            await ops.cancel_transfer(b, t_id)
        assert not b.regions.get("dst").busy, "the cancel answered while its decode still wrote the blocks"
        assert await b.quiet(t_id, 0)
        assert await b.quiet("no-such-transfer", 0)

    _run(body)


def test_cancels_over_rest_answer_after_the_receivers_decode():
    """Real sidecars: a 256 MiB transfer cancelled on the receiver as its chunks are decoded; right
    after each DELETE answers, the region lists no transfer at work in it."""
    a, b = spawn("tcp"), spawn("tcp")
    try:
        blocks = 64
        a.client.region_from_tensor("src", (torch.randn(blocks, 2048, 1024) * 0.05).to(torch.bfloat16))
        b.client.create_region("dst", blocks, [2048, 1024], "bfloat16")
        for _ in range(4):
            transfer = a.client.submit("src", list(range(blocks)), b.data, "dst", list(range(blocks)),
                                       codec="splitzip")
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, "the receiver decoded nothing"
                try:
                    record = b.client.transfer(transfer)
                except NotFound:  # not announced there yet
                    continue
                if record["state"] == "running" and record["blocks_done"]:
                    break
                time.sleep(0.005)
            response = httpx.delete(f"{b.url}/v1/transfers/{transfer}", headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code in (200, 409), response.text
            assert b.client.region("dst")["busy_transfers"] == [], "the cancel answered while its decode still ran"
            assert a.client.transfer(transfer, wait=30)["state"] in ("cancelled", "failed", "done")
    finally:
        stop(a, b)
