"""A transfer ends whatever phase it is aborted in: before its task starts, between chunks, after
its last chunk (waiting for DONE, with or without a task), and under a standing lease (while the
sender writes, and after). Two real engines over TCP on loopback, in one process, so that each
abort lands in the phase named. After each: both records are terminal, nothing holds a link, a
region or a posted receive, and the next transfer between the two is done."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from multiprocessing import shared_memory

import pytest
import torch

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, State, TransferSpec, outgoing
from kvferry.engine.states import Phase

BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 400  # 6.25 MiB: more than rides inline


def _run(body, shm: bool = False, **settings):
    async def main():
        engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=10, **settings))
                   for _ in range(2)]
        segment = None
        for e in engines:
            await e.start()
        try:
            a, b = engines
            src = await a.register_region(RegionSpec("src", BLOCKS, BLOCK, "bfloat16"))
            src.tensor.copy_(torch.randn(BLOCKS, *BLOCK).to(torch.bfloat16))
            if shm:
                segment = shared_memory.SharedMemory(name=f"kvferry-t{uuid.uuid4().hex[:12]}", create=True,
                                                     size=BLOCKS * BLOCK[0] * 2)
                await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm", shm_name=segment.name))
            else:
                await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16"))
            await body(a, b)
        finally:
            for e in engines:
                await e.close()
            if segment is not None:
                segment.close()
                segment.unlink()

    asyncio.run(asyncio.wait_for(main(), 120))


def _spec(b: Engine, src: list[int], dst: list[int], codec: str = "raw") -> TransferSpec:
    return TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(src),
                        dst_blocks=Blocks.of(dst), codec=codec)


async def _until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def _phases(engine: Engine) -> list[tuple[str, Phase, Phase]]:
    """Every change of phase ``engine`` makes, as (transfer id, from, to)."""
    seen: list[tuple[str, Phase, Phase]] = []
    engine.driver.watchers.append(lambda t, before: seen.append((t.id, before, t.phase)))
    return seen


def _silent_done(b: Engine) -> None:
    """``b`` writes every block but never sends its DONE: its senders wait after their last chunk."""
    tell = b.driver._tell
    b.driver._tell = lambda t, what: None if what.message == "done" else tell(t, what)


async def _settled(a: Engine, b: Engine, t_id: str) -> None:
    """Both ends are terminal and hold nothing; the regions can go and the next transfer is done."""
    # A region is let go once the ended transfer's task is over (work it awaited included).
    await _until(lambda: (b.transfers.find(t_id) is None or b.transfers.find(t_id).state.terminal)
                 and not b.links and not a.links and not a.regions.get("src").busy and not b.regions.get("dst").busy)
    assert a.transfers.get(t_id).state.terminal
    assert not a.transfers.active() and not b.transfers.active()
    received = b.transfers.find(t_id)
    assert received is None or not getattr(received, "cleanups", [])
    record = await a.wait(a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS)))).id, 30)
    assert record["state"] == "done", record


def test_cancelled_before_its_task_starts():
    async def body(a, b):
        seen = _phases(a)
        t = a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS))))
        assert t.task is not None and t.phase == Phase.QUEUED  # its task has not run yet
        a.cancel(t.id)
        assert t.state == State.CANCELLED and seen == [(t.id, Phase.QUEUED, Phase.CANCELLED)]
        await asyncio.sleep(0.05)
        assert t.task.done() and b.transfers.find(t.id) is None  # nothing reached the peer
        await _settled(a, b, t.id)

    _run(body)


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_cancelled_between_chunks(side):
    async def body(a, b):
        t = a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS)), codec="raw"))
        await _until(lambda: b.transfers.find(t.id) is not None and b.transfers.find(t.id).blocks_done > 0)
        incoming = b.transfers.find(t.id)
        assert t.phase == Phase.STREAMING and incoming.phase == Phase.RECEIVING
        assert incoming.blocks_done < BLOCKS
        (a if side == "sender" else b).cancel(t.id)
        await _until(lambda: t.state.terminal and incoming.state.terminal)
        assert incoming.state == State.CANCELLED and t.state == State.CANCELLED, (t.error, incoming.error)
        await _settled(a, b, t.id)
        assert incoming.blocks_done < BLOCKS

    # 1 MiB chunks (none inline) paced at 20 MB/s: seven chunks over about 0.3 s
    _run(body, chunk_bytes=1 << 20, emulated_link_gbps=0.02)


@pytest.mark.parametrize("blocks", [2, BLOCKS], ids=["inline, no task", "streamed"])
def test_cancelled_after_the_last_chunk(blocks):
    async def body(a, b):
        ids = list(range(blocks))
        await a.wait(a.submit(_spec(b, [0], [0])).id, 10)  # the pooled connection is open
        _silent_done(b)
        t = a.submit(_spec(b, ids, ids))
        await _until(lambda: t.phase == Phase.CONFIRMING)
        await _until(lambda: b.transfers.find(t.id) is not None and b.transfers.find(t.id).state == State.DONE)
        assert (t.task is None) == (blocks == 2)
        a.cancel(t.id)
        assert t.state == State.CANCELLED
        b.driver._tell = type(b.driver)._tell.__get__(b.driver)
        await _settled(a, b, t.id)
        assert b.transfers.get(t.id).state == State.DONE  # the receiver's record stands: it wrote every block

    _run(body, chunk_bytes=1 << 20)


@pytest.mark.parametrize("where", ["while writing", "after writing"])
def test_cancelled_under_a_lease(where, monkeypatch):
    written = threading.Event()
    write = outgoing.write_blocks

    def slow(*args):
        time.sleep(0.3)
        write(*args)
        written.set()

    async def body(a, b):
        ids = list(range(300))
        record = await a.wait(a.submit(_spec(b, ids, ids, codec="auto")).id, 10)  # takes the standing lease
        assert "same host" in record["choice_reason"], record
        if where == "while writing":
            monkeypatch.setattr(outgoing, "write_blocks", slow)
            t = a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS))))  # large: its task writes in a thread
            await _until(lambda: t.phase == Phase.WRITING)
            a.cancel(t.id)
            assert t.state == State.CANCELLED
            await asyncio.to_thread(written.wait, 5)  # the copy under way finishes on its own
            monkeypatch.setattr(outgoing, "write_blocks", write)
            assert b.transfers.find(t.id) is None  # announced only behind the data: never
        else:
            _silent_done(b)
            t = a.submit(_spec(b, [1, 2], [3, 4]))  # small: written and announced by submit itself
            assert t.task is None and t.phase == Phase.CONFIRMING
            a.cancel(t.id)
            b.driver._tell = type(b.driver)._tell.__get__(b.driver)
        await _settled(a, b, t.id)
        await b.delete_region("dst")  # the lease is given back: no write of it is under way

    _run(body, shm=True)


def _slow_raw_encode(monkeypatch, seconds: float) -> tuple[threading.Event, threading.Event]:
    """raw's encode (a chunk in a worker thread) takes ``seconds`` longer; events: inside it, over."""
    from kvferry import codec as codecs

    raw = codecs.get("raw")
    encode, inside, over = raw.encode_blocks, threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        inside.set()
        time.sleep(seconds)
        try:
            return encode(*args, **kwargs)
        finally:
            over.set()

    monkeypatch.setattr(raw, "encode_blocks", slow)
    return inside, over


def test_a_cancelled_transfers_regions_stay_busy_until_its_worker_thread_is_over(monkeypatch):
    """A chunk encoded in a worker thread (here made slow) when its transfer is cancelled: the
    thread cannot be stopped and reads the source region to its end, so the region stays busy
    until then. A delete while the transfer runs is refused at once; one after the cancel waits
    for the thread, then deletes (a second one waiting beside it finds it gone); the next transfer
    is done."""
    from kvferry.engine.errors import Conflict, NotFound

    async def body(a, b):
        inside, over = _slow_raw_encode(monkeypatch, 1.0)  # long beside what follows, on a loaded machine too
        t = a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS))))
        await asyncio.to_thread(inside.wait, 5)
        with pytest.raises(Conflict, match=r"in use by transfers \['[0-9a-f]+'\]$"):
            await a.delete_region("src")  # in progress: refused without waiting for it
        assert not over.is_set()
        a.cancel(t.id)
        assert t.state == State.CANCELLED and not over.is_set()
        assert a.regions.get("src").busy == {t.id}
        twice = await asyncio.gather(a.delete_region("src"), a.delete_region("src"), return_exceptions=True)
        assert over.is_set()  # not freed under the thread's read
        assert sorted(type(r).__name__ for r in twice) == ["NoneType", "NotFound"], twice
        with pytest.raises(NotFound):
            a.regions.get("src")
        monkeypatch.undo()
        src = await a.register_region(RegionSpec("src", BLOCKS, BLOCK, "bfloat16"))
        src.tensor.copy_(torch.randn(BLOCKS, *BLOCK).to(torch.bfloat16))
        await _settled(a, b, t.id)

    # 1 MiB chunks (64 blocks: encoded in a worker thread), no lease (an emulated link)
    _run(body, chunk_bytes=1 << 20, emulated_link_gbps=0.02)


def test_a_delete_waits_for_an_ended_transfers_work_only_so_long(monkeypatch):
    """Work of a cancelled transfer that outlasts ``close_timeout``: the delete is refused, saying
    why, and the region is kept (the thread still reads it); once the work is over it can go."""
    import dataclasses

    from kvferry.engine.errors import Conflict

    async def body(a, b):
        a.transport_config = dataclasses.replace(a.transport_config, close_timeout=0.2)
        inside, over = _slow_raw_encode(monkeypatch, 2.0)
        t = a.submit(_spec(b, list(range(BLOCKS)), list(range(BLOCKS))))
        await asyncio.to_thread(inside.wait, 5)
        a.cancel(t.id)
        with pytest.raises(Conflict, match="ended; work they started did not finish within 0.2 s"):
            await a.delete_region("src")
        assert not over.is_set() and a.regions.get("src").busy == {t.id}
        await asyncio.to_thread(over.wait, 10)
        monkeypatch.undo()
        await _until(lambda: not a.regions.get("src").busy)
        await a.delete_region("src")

    _run(body, chunk_bytes=1 << 20, emulated_link_gbps=0.02)
