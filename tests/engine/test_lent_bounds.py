"""A sender checks every target it is lent before it writes: a shared-memory target must be named
with the settings' ``shm_prefix``, must not be one of the sender's own segments, and must hold the
offset plus every block the lease claims, checked again before each write (a segment shrunk from
outside fails that transfer with a clear error instead of killing the sender with SIGBUS). A lie
fails one transfer, writes nothing, and the next honest transfer works. Two real engines over TCP
on loopback, in one process, with host shared memory."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import uuid
from multiprocessing import shared_memory

import pytest
import torch

from kvferry.engine import RegionSpec, State, peer
from kvferry.engine.errors import TransferFailed
from kvferry.engine.leases import Held
from tests.engine.test_leases import BLOCK, BLOCKS, _connection, _held, _landed, _run, _sent, _spec

BLOCK_BYTES = BLOCK[0] * 2


def _target(name: str, offset: int = 0, num_blocks: int = BLOCKS) -> peer.Target:
    """A target of the segment ``name`` names now (its identity told truly; the rest may lie)."""
    return peer.Target(name.encode().ljust(peer.HANDLE_BYTES, b"\0"), offset, peer.HOST_MEMORY, num_blocks,
                       peer.segment_id(os.stat(f"/dev/shm/{name}")))


async def _lease(a, b, segments) -> list[Held]:
    """The first (honest) transfer: the receiver lends its segment; the lease it leaves."""
    ids = list(range(300))
    record = await a.wait(a.submit(_spec(b, ids, ids)).id, 10)
    assert record["state"] == "done" and "same host" in record["choice_reason"], record
    held = _held(a, b)
    assert held is not None and held[0].target.handle.rstrip(b"\0").decode() == segments[0].name
    return held


async def _refused(a, b, segments, target: peer.Target, src: list[int], dst: list[int], match: str) -> None:
    """A transfer under a lease of ``target`` fails with ``match`` and writes nothing; under the
    honest lease again, the next one lands bit-exact."""
    honest = _held(a, b)
    before = _landed(segments[0], list(range(BLOCKS))).clone()
    a.leases.hold(_connection(a, b), [Held("dst", target, BLOCK, "bfloat16")])
    t = a.submit(_spec(b, src, dst))
    with pytest.raises(TransferFailed, match=match):
        await a.wait(t.id, 10)
    assert a.status(t.id)["state"] == State.FAILED.value
    assert "cannot write into the receiver's memory" in a.status(t.id)["error"]
    assert torch.equal(_landed(segments[0], list(range(BLOCKS))), before)  # nothing written
    a.leases.hold(_connection(a, b), honest)
    again = [BLOCKS - 1 - i for i in src]
    record = await a.wait(a.submit(_spec(b, src, again)).id, 10)
    assert record["state"] == "done" and "same host" in record["choice_reason"], record
    assert torch.equal(_landed(segments[0], again), _sent(a, src))


@pytest.mark.parametrize("blocks", [[3], list(range(40, 340))], ids=["one-block", "many-blocks"])
def test_an_offset_past_the_segment_is_refused(blocks):
    async def body(a, b, segments):
        await _lease(a, b, segments)
        lie = _target(segments[0].name, offset=BLOCK_BYTES * 50)  # BLOCKS blocks from there overrun it
        await _refused(a, b, segments, lie, blocks, [BLOCKS - 1 - i for i in blocks], "holds .* bytes")

    _run(body)


def test_a_block_count_past_the_segment_is_refused():
    async def body(a, b, segments):
        await _lease(a, b, segments)
        lie = _target(segments[0].name, num_blocks=BLOCKS * 2)  # block BLOCKS + 5 would be past its end
        await _refused(a, b, segments, lie, [1, 2], [BLOCKS + 5, 0], "holds .* bytes")

    _run(body)


def test_a_segment_not_named_with_the_prefix_is_refused():
    outside = shared_memory.SharedMemory(name=f"other-{uuid.uuid4().hex[:12]}", create=True, size=BLOCKS * BLOCK_BYTES)
    try:
        async def body(a, b, segments):
            await _lease(a, b, segments)
            await _refused(a, b, segments, _target(outside.name), [4], [5], "not named with 'kvferry-'")
            assert not outside.buf.tobytes().strip(b"\0")  # untouched

        _run(body)
    finally:
        outside.close()
        outside.unlink()


def test_a_target_naming_another_segment_than_the_receivers_is_refused():
    """The name is the receiver's, the identity another segment's: the sender cannot know which
    memory the receiver reads, so it writes into neither."""
    other = shared_memory.SharedMemory(name=f"kvferry-other{uuid.uuid4().hex[:12]}", create=True,
                                       size=BLOCKS * BLOCK_BYTES)
    try:
        async def body(a, b, segments):
            await _lease(a, b, segments)
            lie = dataclasses.replace(_target(segments[0].name), segment=_target(other.name).segment)
            await _refused(a, b, segments, lie, [4], [5], "not the segment it lent")
            assert not other.buf.tobytes().strip(b"\0")

        _run(body)
    finally:
        other.close()
        other.unlink()


def test_the_senders_own_segment_is_refused():
    own = shared_memory.SharedMemory(name=f"kvferry-own{uuid.uuid4().hex[:12]}", create=True,
                                     size=BLOCKS * BLOCK_BYTES)
    try:
        async def body(a, b, segments):
            await a.register_region(RegionSpec("mine", BLOCKS, BLOCK, "bfloat16", kind="shm", shm_name=own.name))
            await _lease(a, b, segments)
            await _refused(a, b, segments, _target(own.name), [4, 9], [5, 6], "sender's own region 'mine'")
            assert not own.buf.tobytes().strip(b"\0")

        _run(body)
    finally:
        own.close()
        own.unlink()


def test_a_region_the_sender_registers_over_its_lease_later_is_refused():
    """The views of lent memory are kept between writes and checked again whenever the sender's
    regions change: a region registered after the lease was used, over the very segment it lends,
    stops the next write before it touches it."""
    async def body(a, b, segments):
        await _lease(a, b, segments)
        record = await a.wait(a.submit(_spec(b, [1], [2])).id, 10)  # the lent view is open and kept
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        await a.register_region(RegionSpec("mine", BLOCKS, BLOCK, "bfloat16", kind="shm",
                                           shm_name=segments[0].name))
        before = _landed(segments[0], list(range(BLOCKS))).clone()
        t = a.submit(_spec(b, [4], [5]))
        with pytest.raises(TransferFailed, match="sender's own region 'mine'"):
            await a.wait(t.id, 10)
        assert torch.equal(_landed(segments[0], list(range(BLOCKS))), before)  # nothing written
        await a.delete_region("mine")
        record = await a.wait(a.submit(_spec(b, [4], [5])).id, 10)
        assert record["state"] == "done" and torch.equal(_landed(segments[0], [5]), _sent(a, [4]))

    _run(body)


def test_a_segment_shrunk_from_outside_fails_the_transfer_not_the_sender():
    """The sender holds a mapping of the receiver's segment; another process truncates it. The next
    write is refused before it touches the mapping (which would raise SIGBUS); once the segment is
    its size again, transfers land. The refusals leave nothing that keeps the mapping open: once the
    engines are closed, collecting their garbage closes no mapping that still has a view."""
    async def body(a, b, segments):
        await _lease(a, b, segments)
        size = segments[0].size
        fd = os.open(f"/dev/shm/{segments[0].name}", os.O_RDWR)
        try:
            os.ftruncate(fd, BLOCK_BYTES * 10)
            for ids in ([2], list(range(300))):  # the path written at once, and the task's
                t = a.submit(_spec(b, ids, ids))
                with pytest.raises(TransferFailed, match="holds 163840 bytes"):
                    await a.wait(t.id, 10)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        ids = list(range(BLOCKS))
        record = await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 10)
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        assert torch.equal(_landed(segments[0], ids[::-1]), _sent(a, ids))

    unraisable = []
    before, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        _run(body)
        gc.collect()
    finally:
        sys.unraisablehook = before
    assert not unraisable, [u.exc_value for u in unraisable]


def test_a_target_opened_from_several_threads_at_once_is_opened_once():
    """A sidecar writes from its event loop and from worker threads at once: they share the opened
    segment (one mapping, one descriptor, one view), and none is dropped while its view is in use
    (its finalizer would then fail, and the descriptor leak until it ran)."""
    import threading

    from kvferry.engine import ipc

    segment = shared_memory.SharedMemory(name=f"kvferry-t{uuid.uuid4().hex[:12]}", create=True,
                                         size=BLOCKS * BLOCK_BYTES)
    try:
        target = _target(segment.name)
        for _ in range(20):
            mapper = ipc.Mapper()
            start, views, failures = threading.Barrier(8), [], []

            def open_it() -> None:
                start.wait()
                try:
                    views.append(mapper.tensor(target, (BLOCKS, *BLOCK), torch.bfloat16))
                except Exception as exc:  # noqa: BLE001 (reported below)
                    failures.append(exc)

            threads = [threading.Thread(target=open_it) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not failures and len(views) == 8
            assert len({view.data_ptr() for view in views}) == 1 and len(mapper._shm) == 1
            views.clear()
            mapper.close()
    finally:
        segment.close()
        segment.unlink()
