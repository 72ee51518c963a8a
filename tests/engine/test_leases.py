"""Standing leases of same-host memory (peer protocol v3), with host shared memory standing in for
a GPU's CUDA IPC (the same code path past the mapping): two real engines over TCP on loopback, in
one process. The first transfer into a lent region is written after the receiver's ACCEPT; later
ones are written at once and announced behind the data; deleting the region revokes the lease
before the memory goes."""

from __future__ import annotations

import asyncio
import gc
import contextlib
import os
import time
import uuid
import weakref
from multiprocessing import shared_memory

import pytest
import torch

from kvferry.engine import Blocks, Engine, RegionSpec, Settings, State, TransferSpec, peer
from kvferry.engine.errors import Conflict, NotFound, TransferFailed
from kvferry.engine import leases
from kvferry.engine.leases import Held, Leases

BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 400  # 6.25 MiB: more than rides inline, so the first transfer offers to write itself


def _segment() -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(name=f"kvferry-t{uuid.uuid4().hex[:12]}", create=True,
                                      size=BLOCKS * BLOCK[0] * 2)


def _run(body, **settings):
    async def main():
        engines = [Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=10,
                                   **settings)) for _ in range(2)]
        segments = []
        for e in engines:
            await e.start()
        try:
            a, b = engines
            src = await a.register_region(RegionSpec("src", BLOCKS, BLOCK, "bfloat16"))
            src.tensor.copy_(torch.randn(BLOCKS, *BLOCK).to(torch.bfloat16))
            segments.append(_segment())
            await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm",
                                               shm_name=segments[-1].name))
            await body(a, b, segments)
        finally:
            for e in engines:
                await e.close()
            for segment in segments:
                segment.close()
                with contextlib.suppress(FileNotFoundError):  # a test may have unlinked it already
                    segment.unlink()

    asyncio.run(asyncio.wait_for(main(), 120))


def _spec(b: Engine, src: list[int], dst: list[int], codec: str = "raw") -> TransferSpec:
    return TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks.of(src),
                        dst_blocks=Blocks.of(dst), codec=codec)


def _landed(segment: shared_memory.SharedMemory, ids: list[int]) -> torch.Tensor:
    view = torch.frombuffer(segment.buf, dtype=torch.int16).view(BLOCKS, *BLOCK)
    return view[ids].clone()


def _sent(a: Engine, ids: list[int]) -> torch.Tensor:
    return a.regions.get("src").tensor.view(torch.int16)[ids]


def _connection(a: Engine, b: Engine):
    host, port = b.data_address.rsplit(":", 1)
    return a.pool.ready(host, int(port))


def _held(a: Engine, b: Engine) -> list[Held] | None:
    return a.leases.held(_connection(a, b), ["dst"], [BLOCK], "bfloat16")


async def _incoming(b: Engine, transfer_id: str) -> dict:
    for _ in range(100):
        record = b.status(transfer_id)
        if record["state"] != "running":
            return record
        await asyncio.sleep(0.01)
    return record


def test_the_first_transfer_leases_the_region_and_later_ones_are_written_at_once():
    async def body(a, b, segments):
        first = list(range(300))
        dst = [BLOCKS - 1 - i for i in first]
        record = await a.wait(a.submit(_spec(b, first, dst, codec="auto")).id, 10)
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        assert record["chosen_codec"] == "raw" and torch.equal(_landed(segments[0], dst), _sent(a, first))
        assert _held(a, b) is not None
        for i in range(5):  # small: written and announced by submit itself, no task
            src_ids, dst_ids = [i, i + 7], [3 * i + 1, 200 + i]
            t = a.submit(_spec(b, src_ids, dst_ids))
            assert t.task is None and t.state == State.RUNNING and "same host" in t.choice_reason
            done = await a.wait(t.id, 5)
            assert done["state"] == "done" and done["blocks_done"] == 2
            assert torch.equal(_landed(segments[0], dst_ids), _sent(a, src_ids))
            incoming = await _incoming(b, t.id)
            assert incoming["state"] == "done" and incoming["blocks_done"] == 2
        big = list(range(BLOCKS))  # large: the task path, still under the lease
        t = a.submit(_spec(b, big, big[::-1]))
        assert t.task is not None
        record = await a.wait(t.id, 10)
        assert record["state"] == "done" and "same host" in record["choice_reason"] and record["stages"].get("accepted") is None
        assert torch.equal(_landed(segments[0], big[::-1]), _sent(a, big))
        assert not a.links and not b.links and not a.transfers.active() and not b.transfers.active()

    _run(body)


def test_a_leased_write_is_announced_before_the_senders_own_bookkeeping():
    """The receiver's work starts as soon as the blocks are in its memory: the announce leaves
    while the transfer has not moved yet, and the moves, link and deadline follow it."""

    async def body(a, b, segments):
        first = list(range(300))
        await a.wait(a.submit(_spec(b, first, first, codec="auto")).id, 10)  # takes the lease
        connection, seen = _connection(a, b), []
        post = connection.post_message

        def spy(*payloads, written=None):
            message = peer.unpack(payloads[0])
            if isinstance(message.body, peer.Announce):
                t = a.transfers.find(message.transfer_id)
                seen.append((t.phase.value, a.links.get(t.id), t.deadline, t.stages.get("last_byte") is not None))
            post(*payloads, written=written)

        connection.post_message = spy
        t = a.submit(_spec(b, [4, 9], [30, 31]))
        assert t.task is None
        record = await a.wait(t.id, 5)
        assert record["state"] == "done" and torch.equal(_landed(segments[0], [30, 31]), _sent(a, [4, 9]))
        assert seen == [("queued", None, None, True)]  # written already; not yet moved, linked or timed

    _run(body)


def test_a_cancelled_write_holds_its_lease_until_its_copy_is_over(monkeypatch):
    """A write copied in a worker thread (here made slow) and cancelled mid-copy: the thread
    cannot be stopped, so the lease is let go (a REVOKE answered) only once the copy is over,
    never while it still writes the receiver's memory. The sidecar goes on serving."""
    from kvferry.engine import outgoing

    async def body(a, b, segments):
        first = list(range(300))
        await a.wait(a.submit(_spec(b, first, first, codec="auto")).id, 10)  # takes the lease
        order, real_write, real_end = [], outgoing.write_blocks, a.leases.end

        def slow_write(*args, **kwargs):
            time.sleep(0.4)
            real_write(*args, **kwargs)
            order.append("copy over")

        def end(connection, helds):
            order.append("lease let go")
            real_end(connection, helds)

        monkeypatch.setattr(outgoing, "write_blocks", slow_write)
        monkeypatch.setattr(a.leases, "end", end)
        blocks = list(range(100))  # 1.6 MiB: copied in a worker thread
        t = a.submit(_spec(b, blocks, blocks))
        await asyncio.sleep(0.1)
        assert a.cancel(t.id)["state"] == "cancelled"
        for _ in range(500):  # the copy takes 0.4 s; both are in within 5 s
            if len(order) == 2:
                break
            await asyncio.sleep(0.01)
        assert order == ["copy over", "lease let go"]
        monkeypatch.setattr(outgoing, "write_blocks", real_write)
        record = await a.wait(a.submit(_spec(b, [4], [5])).id, 5)
        assert record["state"] == "done" and torch.equal(_landed(segments[0], [5]), _sent(a, [4]))

    _run(body)


def test_one_sidecars_writes_into_host_memory_are_copied_one_at_a_time(monkeypatch):
    """Two large same-host writes into host memory submitted at once (each copied in a worker
    thread, here made slow): the second copy starts once the first is over, and both land."""
    from kvferry.engine import outgoing

    async def body(a, b, segments):
        first = list(range(300))
        await a.wait(a.submit(_spec(b, first, first, codec="auto")).id, 10)  # takes the lease
        spans, real_write = [], outgoing.write_blocks

        def timed_write(*args, **kwargs):
            start = time.monotonic()
            time.sleep(0.2)
            real_write(*args, **kwargs)
            spans.append((start, time.monotonic()))

        monkeypatch.setattr(outgoing, "write_blocks", timed_write)
        sources = [list(range(0, 100)), list(range(100, 200))]
        destinations = [list(range(300, 400)), list(range(200, 300))]
        ts = [a.submit(_spec(b, s, d)) for s, d in zip(sources, destinations)]
        records = [await a.wait(t.id, 5) for t in ts]
        assert [r["state"] for r in records] == ["done", "done"]
        (_, first_over), (second_start, _) = sorted(spans)
        assert first_over <= second_start
        for s, d in zip(sources, destinations):
            assert torch.equal(_landed(segments[0], d), _sent(a, s))

    _run(body)


def test_a_leased_write_takes_one_move_on_each_side_before_its_end():
    """Written and announced before any move, the sender's record goes from queued to confirming
    in one move; the receiver's, admitted with every block in place, from queued to done in one."""

    async def body(a, b, segments):
        first = list(range(300))
        await a.wait(a.submit(_spec(b, first, first, codec="auto")).id, 10)  # takes the lease
        moves: list[tuple[str, str, str]] = []
        for engine in (a, b):
            engine.driver.watchers.append(lambda t, before: moves.append((t.direction, before.value, t.phase.value)))
        t = a.submit(_spec(b, [7], [8]))
        record = await a.wait(t.id, 5)
        assert record["state"] == "done" and torch.equal(_landed(segments[0], [8]), _sent(a, [7]))
        incoming = await _incoming(b, t.id)
        assert incoming["state"] == "done" and incoming["blocks_done"] == 1, incoming
        assert sorted(moves) == [("in", "queued", "done"),
                                 ("out", "confirming", "done"), ("out", "queued", "confirming")]

    _run(body)


def test_spread_ids_are_written_under_the_lease_as_their_ids(monkeypatch):
    """vLLM's request across a cache's planes (ids each standing for ``count`` blocks ``stride``
    apart) goes to the copy as its short id lists, the destination's stride running backwards."""
    from kvferry.codec import blockcopy

    original, spreads = blockcopy.copy_spread, []

    def spy(*args):
        spreads.append(args[4:])  # (count, source stride, destination stride)
        original(*args)

    monkeypatch.setattr(blockcopy, "copy_spread", spy)

    async def body(a, b, segments):
        await a.wait(a.submit(_spec(b, list(range(300)), list(range(300)), codec="auto")).id, 10)  # takes the lease
        src, dst = (5, 0, 99, 42), (310, 350, 303, 377)
        spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst"),), src_blocks=Blocks(ids=src, spread=(4, 100)),
                            dst_blocks=Blocks(ids=dst, spread=(4, -100)), codec="auto")
        record = await a.wait(a.submit(spec).id, 10)
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        assert spreads == [(4, 100, -100)]
        every_src = [s + 100 * j for s in src for j in range(4)]
        every_dst = [d - 100 * j for d in dst for j in range(4)]
        assert torch.equal(_landed(segments[0], every_dst), _sent(a, every_src))

    _run(body)


def test_a_codec_asked_for_by_name_still_streams():
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        assert _held(a, b) is not None
        record = await a.wait(a.submit(_spec(b, ids, ids[::-1], codec="splitzip")).id, 10)
        assert record["chosen_codec"] == "splitzip" and record["bytes_wire"] < record["bytes_raw"], record
        assert torch.equal(_landed(segments[0], ids[::-1]), _sent(a, ids))

    _run(body)


def test_deleting_a_leased_region_revokes_the_lease_before_the_memory_goes():
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        assert _held(a, b) is not None
        await b.delete_region("dst")
        assert _held(a, b) is None  # the sender gave it back (REVOKED) before delete returned
        with pytest.raises(TransferFailed, match="NotFound"):  # the region is gone: nothing written
            await a.wait(a.submit(_spec(b, [0], [0])).id, 10)
        segments.append(_segment())  # a new region of that name: leased afresh, written where it now lives
        await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm", shm_name=segments[-1].name))
        assert (await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 10))["state"] == "done"
        assert torch.equal(_landed(segments[-1], ids[::-1]), _sent(a, ids))
        small = a.submit(_spec(b, [5], [6]))
        assert small.task is None and (await a.wait(small.id, 5))["state"] == "done"
        assert torch.equal(_landed(segments[-1], [6]), _sent(a, [5]))

    _run(body)


def test_a_revocation_nobody_confirms_quarantines_the_region_instead_of_deleting_it():
    """A sender stopped mid-write under a lease cannot confirm the REVOKE; closing its connection
    does not stop a write it already began. The region is kept (lent to nobody, taking no
    transfers) so its memory is not reused under that write, until its owner forces the delete."""
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        assert _held(a, b) is not None
        a.leases.on_revoke = lambda connection, name: None  # stopped: it never answers
        with pytest.raises(Conflict, match="quarantined"):
            await b.delete_region("dst")
        assert b.regions.get("dst").quarantined
        with pytest.raises(Conflict, match="quarantined"):  # asked again: still not deleted
            await b.delete_region("dst")
        with pytest.raises(TransferFailed):  # nothing is written into it meanwhile
            await a.wait(a.submit(_spec(b, [0], [0])).id, 10)
        with pytest.raises(Conflict, match="quarantined"):  # nor through a view of it
            b.regions.view("dst-request", "dst")
        await b.delete_region("dst", force=True)
        with pytest.raises(NotFound):
            b.regions.get("dst")

    _run(body)


def test_a_sender_that_does_not_give_one_lease_back_leaves_every_region_lent_to_it_quarantined():
    """A sender stopped mid-write may be writing any region lent to it, not only the one being
    deleted: closing its connection ends its other leases too, and none of that memory may be
    freed as if it had been given back."""
    async def body(a, b, segments):
        segments.append(_segment())
        await b.register_region(RegionSpec("dst2", BLOCKS, BLOCK, "bfloat16", kind="shm",
                                           shm_name=segments[-1].name))
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        spec = TransferSpec(peer=b.data_address, pairs=(("src", "dst2"),), src_blocks=Blocks.of(ids),
                            dst_blocks=Blocks.of(ids), codec="raw")
        assert (await a.wait(a.submit(spec).id, 10))["state"] == "done"
        a.leases.on_revoke = lambda connection, name: None  # stopped: it never answers
        with pytest.raises(Conflict, match="quarantined"):
            await b.delete_region("dst")
        with pytest.raises(Conflict, match="quarantined"):
            await b.delete_region("dst2")
        assert "dst" in b.regions.get("dst2").quarantined  # says which delete found the sender silent
        await b.delete_region("dst2", force=True)  # its owner knows that sender is gone

    _run(body)


def test_a_second_delete_while_a_revocation_waits_frees_nothing_until_the_first_has_ended():
    """While one delete waits for a sender to give its lease back, another delete of the region
    (forced, even) must not free the memory that sender may still write: it waits its turn."""
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        a.leases.on_revoke = lambda connection, name: None  # stopped: it never answers
        first = asyncio.ensure_future(b.delete_region("dst"))
        await asyncio.sleep(0.2)
        second = asyncio.ensure_future(b.delete_region("dst", force=True))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()  # the first waits for the REVOKED
        assert b.regions.get("dst").quarantined is None  # still registered, its memory kept
        with pytest.raises(Conflict, match="quarantined"):
            await first
        await second  # then forced, by its owner who knows that sender is gone
        with pytest.raises(NotFound):
            b.regions.get("dst")

    _run(body)


def test_no_view_is_made_of_a_region_while_its_delete_waits_for_a_revocation():
    """A view made while the delete of its base waits for a sender's REVOKED would be left over
    memory the delete then frees: it is refused, and the delete goes through."""
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        answer = a.leases.on_revoke
        a.leases.on_revoke = lambda connection, name: asyncio.get_running_loop().call_later(
            0.5, answer, connection, name)  # a slow sender: it confirms half a second later
        delete = asyncio.ensure_future(b.delete_region("dst"))
        await asyncio.sleep(0.2)
        assert not delete.done()
        with pytest.raises(Conflict, match="being deleted"):
            b.regions.view("dst-request", "dst")
        await delete
        with pytest.raises(NotFound):
            b.regions.get("dst-request")

    _run(body)


def test_a_name_given_to_a_new_segment_is_written_there():
    """The worker deletes its region, unlinks the segment and registers a new one under the same
    name. The sender, which still has the old segment open, writes into the new one: every block
    lands where the receiver reads it, none in the memory it let go."""
    async def body(a, b, segments):
        first = list(range(300))
        record = await a.wait(a.submit(_spec(b, first, first)).id, 10)  # lent: the old segment opens in the sender
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        record = await a.wait(a.submit(_spec(b, [1], [2])).id, 10)  # written at once, under the lease
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        await b.delete_region("dst")
        old = segments.pop()
        old.unlink()
        segments.append(shared_memory.SharedMemory(name=old.name, create=True, size=old.size))
        await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm", shm_name=old.name))
        before = _landed(old, list(range(BLOCKS)))
        leased = 0
        for i in range(6):
            record = await a.wait(a.submit(_spec(b, [10 + i], [20 + i])).id, 10)
            assert record["state"] == "done", record
            leased += "same host" in record["choice_reason"]
        assert leased >= 4  # the first may go over the wire while the lease is lent again
        assert torch.equal(_landed(segments[0], list(range(20, 26))), _sent(a, list(range(10, 16))))
        assert torch.equal(_landed(old, list(range(BLOCKS))), before)
        old.close()

    _run(body)


def test_a_segment_whose_name_was_unlinked_is_streamed():
    """A worker may unlink its segment's name once the sidecar maps it (nothing leaks if it dies).
    No sender can open it by that name then, so the receiver does not lend it: transfers stream
    into it over the connection, and land."""
    async def body(a, b, segments):
        segments[0].unlink()
        for i in range(3):
            ids = list(range(100 * i, 100 * i + 100))
            record = await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 10)
            assert record["state"] == "done" and "same host" not in record["choice_reason"], record
            assert torch.equal(_landed(segments[0], ids[::-1]), _sent(a, ids))
        assert _held(a, b) is None

    _run(body)


def test_a_write_announced_without_a_lease_is_refused():
    """A sender that claims a lease the receiver never lent (or took back) fails its transfer; the
    receiver refuses it before taking it on. An owned region on the CPU is not shareable: the
    receiver declines the offer, and the sender stops offering."""
    async def body(a, b, segments):
        await b.register_region(RegionSpec("own", BLOCKS, BLOCK, "bfloat16"))
        spec = TransferSpec(peer=b.data_address, pairs=(("src", "own"),), src_blocks=Blocks.of([0]),
                            dst_blocks=Blocks.of([0]), codec="raw")
        assert (await a.wait(a.submit(spec).id, 10))["state"] == "done"  # offered, declined: inline
        connection = _connection(a, b)
        assert a.leases.held(connection, ["own"], [BLOCK], "bfloat16") is None
        assert not a.leases.offer_wanted(connection, ["own"]) and a.leases.offer_wanted(connection, ["dst"])
        target = peer.Target(segments[0].name.encode().ljust(peer.HANDLE_BYTES, b"\0"), 0, peer.HOST_MEMORY, BLOCKS,
                             peer.segment_id(os.stat(f"/dev/shm/{segments[0].name}")))
        a.leases.hold(connection, [Held("own", target, BLOCK, "bfloat16")])  # forged
        t = a.submit(TransferSpec(peer=b.data_address, pairs=(("src", "own"),), src_blocks=Blocks.of([1]),
                                  dst_blocks=Blocks.of([2]), codec="raw"))
        assert t.task is None  # written at once, under the lease it claims
        with pytest.raises(TransferFailed, match="ProtocolViolation"):
            await a.wait(t.id, 10)
        assert b.transfers.find(t.id) is None  # refused before the receiver took it on

    _run(body)


def test_an_emulated_link_takes_no_same_host_shortcut():
    async def body(a, b, segments):
        ids = list(range(300))
        record = await a.wait(a.submit(_spec(b, ids, ids)).id, 30)
        assert record["state"] == "done" and "same host" not in record["choice_reason"]
        assert _held(a, b) is None and torch.equal(_landed(segments[0], ids), _sent(a, ids))
        assert (await _incoming(b, record["id"]))["peer"].startswith("127.0.0.1:")  # TCP, as to a remote peer

    _run(body, emulated_link_gbps=1.0)


@pytest.mark.parametrize("local_socket", [True, False])
def test_a_peer_of_this_host_is_reached_over_the_unix_socket_unless_it_is_off(local_socket):
    async def body(a, b, segments):
        ids = list(range(300))
        record = await a.wait(a.submit(_spec(b, ids, ids)).id, 30)
        assert record["state"] == "done" and torch.equal(_landed(segments[0], ids), _sent(a, ids))
        port = b.data_address.rpartition(":")[2]
        peer_seen = (await _incoming(b, record["id"]))["peer"]
        assert (peer_seen == f"unix:{port}") if local_socket else peer_seen.startswith("127.0.0.1:")

    _run(body, local_socket=local_socket)


class _Connection:
    """What ``Leases`` needs of a connection: whether it is closed, and a way to post messages."""

    def __init__(self) -> None:
        self.closed = False
        self.posted: list[peer.Message] = []
        self.peer = "test"

    def post_message(self, *payloads: bytes) -> None:
        self.posted += [peer.unpack(p) for p in payloads]

    async def close(self) -> None:
        self.closed = True


def test_revoked_waits_for_the_writes_under_way():
    leases, connection = Leases(), _Connection()
    target = peer.Target(b"x" * 64, 0, peer.HOST_MEMORY, 4)
    held = Held("dst", target, (4,), "bfloat16")
    leases.hold(connection, [held])
    leases.begin([held])
    leases.on_revoke(connection, "dst")
    assert connection.posted == []  # a write is under way
    assert leases.held(connection, ["dst"], [(4,)], "bfloat16") is None  # and none starts now
    leases.end(connection, [held])
    assert connection.posted == [peer.Message(peer.LINK_ID, peer.Revoked("dst"))]
    leases.on_revoke(connection, "other")  # nothing held: answered at once
    assert connection.posted[-1].body == peer.Revoked("other")


def test_a_sender_that_does_not_give_a_lease_back_loses_its_connection():
    async def main():
        leases, silent, prompt = Leases(), _Connection(), _Connection()
        for c in (silent, prompt):
            leases.lend("dst", c)
        silent.peer = "silent:1"
        revoking = asyncio.ensure_future(leases.revoke("dst", 0.2))
        await asyncio.sleep(0.01)
        assert [m.body for m in silent.posted] == [peer.Revoke("dst")]
        assert leases.on_revoked(prompt, "dst") and not leases.on_revoked(prompt, "dst")
        assert (await revoking).peers == ["silent:1"]  # the caller learns who may still write
        assert silent.closed and not prompt.closed
        assert not leases.lent_to("dst", prompt)

    asyncio.run(asyncio.wait_for(main(), 5))


@pytest.mark.parametrize("lost_first", [True, False])
def test_a_lost_connection_ends_its_leases(lost_first):
    async def main():
        leases, connection = Leases(), _Connection()
        leases.lend("dst", connection)
        leases.hold(connection, [Held("dst", peer.Target(b"x" * 64, 0, peer.HOST_MEMORY, 4), (4,), "bfloat16")])
        if lost_first:
            leases.lost(connection)
            await asyncio.wait_for(leases.revoke("dst", 5), 1)  # nobody left to ask
        else:
            revoking = asyncio.ensure_future(leases.revoke("dst", 5))
            await asyncio.sleep(0.01)
            leases.lost(connection)
            await asyncio.wait_for(revoking, 1)
        assert leases.held(connection, ["dst"], [(4,)], "bfloat16") is None

    asyncio.run(main())


def test_a_region_declined_once_is_offered_again_later(monkeypatch):
    """A receiver may decline to lend a region for a while only: its shared memory's name no
    longer named it, or it was being deleted. Registered anew, it is lent again to the sender
    that was declined, once the decline has stood ``OFFER_AGAIN_AFTER_S``; until then that
    sender streams without offering (an offer costs a transfer its inline chunks and a round trip)."""
    monkeypatch.setattr(leases, "OFFER_AGAIN_AFTER_S", 1.0)

    async def body(a, b, segments):
        segments[0].unlink()  # no sender can open it by name: declined
        ids = list(range(300))
        record = await a.wait(a.submit(_spec(b, ids, ids)).id, 10)
        assert record["state"] == "done" and "same host" not in record["choice_reason"], record
        declined_at = time.monotonic()
        await b.delete_region("dst")
        segments.append(_segment())
        await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm", shm_name=segments[-1].name))
        record = await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 10)
        assert record["state"] == "done" and "same host" not in record["choice_reason"], record
        assert not a.leases.offer_wanted(_connection(a, b), ["dst"])  # streamed, without offering again yet
        await asyncio.sleep(max(0.0, declined_at + 1.0 - time.monotonic()) + 0.05)
        record = await a.wait(a.submit(_spec(b, ids, ids)).id, 10)
        assert record["state"] == "done" and "same host" in record["choice_reason"], record
        assert torch.equal(_landed(segments[-1], ids), _sent(a, ids))
        assert _held(a, b) is not None
        small = a.submit(_spec(b, [5], [6]))  # and written at once under the lease, from now on
        assert small.task is None and (await a.wait(small.id, 5))["state"] == "done"
        assert torch.equal(_landed(segments[-1], [6]), _sent(a, [5]))

    _run(body)


def test_memory_is_let_go_once_no_lease_names_it_and_no_write_into_it_runs():
    """The sender unmaps a receiver's memory once it holds no lease of it: taken back, lent anew
    under another handle, or its connection lost; a write under way keeps it until it ends, and a
    lease of the same memory on another connection keeps it as long as that lease stands."""
    async def main():
        let_go: list[bytes] = []
        sender, one, two = Leases(let_go.append), _Connection(), _Connection()
        first, second = peer.Target(b"a" * 64, 0, peer.HOST_MEMORY, 4), peer.Target(b"b" * 64, 0, peer.HOST_MEMORY, 4)
        sender.hold(one, [Held("dst", first, (4,), "bfloat16")])
        sender.hold(two, [Held("dst", first, (4,), "bfloat16")])
        sender.on_revoke(one, "dst")
        assert let_go == []  # still held on the other connection
        writing = sender.held(two, ["dst"], [(4,)], "bfloat16")
        sender.begin(writing)
        sender.lost(two)
        assert let_go == []  # a write into it is under way
        sender.end(two, writing)
        assert let_go == [first.handle]
        sender.hold(one, [Held("dst", second, (4,), "bfloat16")])
        sender.hold(one, [Held("dst", first, (4,), "bfloat16")])  # lent anew, under another handle
        assert let_go == [first.handle, second.handle]
        sender.lost(one)
        assert let_go == [first.handle, second.handle, first.handle]

    asyncio.run(main())


def test_memory_written_under_a_lost_lease_is_kept_while_another_lease_of_it_ends():
    """A write still copying under a lease whose connection is gone keeps that memory mapped when
    a lease of the same memory on another connection ends meanwhile; the map keeps what a lease
    names or a write runs into (``in_use``), and nothing else."""
    async def main():
        let_go: list[bytes] = []
        sender, one, two = Leases(let_go.append), _Connection(), _Connection()
        lent, other = peer.Target(b"a" * 64, 0, peer.HOST_MEMORY, 4), peer.Target(b"b" * 64, 0, peer.HOST_MEMORY, 4)
        sender.hold(one, [Held("dst", lent, (4,), "bfloat16")])
        sender.hold(two, [Held("dst", lent, (4,), "bfloat16"), Held("dst2", other, (4,), "bfloat16")])
        assert sender.in_use() == {lent.handle, other.handle}
        writing = sender.held(one, ["dst"], [(4,)], "bfloat16")
        sender.begin(writing)
        sender.lost(one)
        sender.on_revoke(two, "dst")
        assert let_go == [] and sender.in_use() == {lent.handle, other.handle}  # still copying into it
        sender.end(one, writing)
        assert let_go == [lent.handle] and sender.in_use() == {other.handle}
        sender.lost(two)
        assert let_go == [lent.handle, other.handle] and sender.in_use() == set()

    asyncio.run(main())


def test_a_lease_taken_back_unmaps_the_receivers_memory_in_the_sender():
    """A worker that deletes its region and registers a new segment, again and again (restarts):
    the sender keeps none of the old segments mapped, so their memory is freed once unlinked."""
    async def body(a, b, segments):
        ids = list(range(300))
        for _ in range(3):
            record = await a.wait(a.submit(_spec(b, ids, ids[::-1])).id, 10)
            assert record["state"] == "done" and "same host" in record["choice_reason"], record
            assert torch.equal(_landed(segments[-1], ids[::-1]), _sent(a, ids))
            old = segments[-1].name
            assert _mapped(old) == 3  # this test's, the receiver's region, the sender's lease
            await b.delete_region("dst")
            gc.collect()
            assert _mapped(old) == 1 and not a.mapper._shm  # this test's own only
            segments.append(_segment())
            await b.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16", kind="shm",
                                               shm_name=segments[-1].name))

    _run(body)


def _mapped(name: str) -> int:
    """How many times this process maps the shared memory ``name``."""
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(f"/dev/shm/{name}") or f"/dev/shm/{name} (deleted)" in line for line in f)


def test_a_write_that_crosses_the_revoke_is_refused_as_the_delete_and_the_delete_is_done(monkeypatch):
    """The worker deletes its region while a sender writes into it under its lease (here made slow):
    the write finishes into memory still lent, is announced before REVOKED, and is refused because
    the region is being deleted, not as a breach of the protocol; transfers that come meanwhile are
    refused alike rather than holding the delete up; the delete is done."""
    from kvferry.engine import outgoing

    async def body(a, b, segments):
        ids = list(range(300))
        await a.wait(a.submit(_spec(b, ids, ids)).id, 10)  # takes the lease
        real_write = outgoing.write_blocks

        def slow_write(*args, **kwargs):
            time.sleep(0.4)
            real_write(*args, **kwargs)

        monkeypatch.setattr(outgoing, "write_blocks", slow_write)
        blocks = list(range(100))  # 1.6 MiB: copied in a worker thread
        crossing = a.submit(_spec(b, blocks, blocks))
        await asyncio.sleep(0.1)
        deleting = asyncio.ensure_future(b.delete_region("dst"))
        await asyncio.sleep(0.05)
        monkeypatch.setattr(outgoing, "write_blocks", real_write)
        meanwhile = a.submit(_spec(b, [1], [2]))  # comes while the region is being deleted
        for t in (crossing, meanwhile):
            with pytest.raises(TransferFailed, match="Conflict: region 'dst' is being deleted"):
                await a.wait(t.id, 10)
        await asyncio.wait_for(deleting, 10)
        with pytest.raises(NotFound):
            b.regions.get("dst")
        assert b.metrics.errors.labels("ProtocolViolation")._value.get() == 0

    _run(body)


def test_a_view_made_or_deleted_on_the_sender_keeps_what_its_map_checked():
    """A lease of a prefill's cache is a view of it, made and deleted per request: it holds no memory
    of its own, so the sender's checked views of lent memory stay, and a write after it is not
    checked and mapped again."""
    async def body(a, b, segments):
        ids = list(range(300))
        assert (await a.wait(a.submit(_spec(b, ids, ids)).id, 10))["state"] == "done"
        assert (await a.wait(a.submit(_spec(b, [1], [2])).id, 10))["state"] == "done"
        checked, version = dict(a.mapper._views), a.regions.version
        a.regions.view("lease-1", "src")
        assert (await a.wait(a.submit(TransferSpec(peer=b.data_address, pairs=(("lease-1", "dst"),),
                                                   src_blocks=Blocks.of([3]), dst_blocks=Blocks.of([4]),
                                                   codec="raw")).id, 10))["state"] == "done"
        await a.delete_region("lease-1")
        assert a.regions.version == version
        assert a.mapper._views.keys() == checked.keys()
        assert all(a.mapper._views[key] is view for key, view in checked.items())  # not made again
        assert torch.equal(_landed(segments[-1], [2, 4]), _sent(a, [1, 3]))

    _run(body)


def test_a_region_the_sender_deletes_is_freed_without_a_later_write():
    """The sender's map of lent memory checks targets against the sender's own regions; it must not
    keep one the sender deleted alive (its memory would stay taken until the next write)."""
    async def body(a, b, segments):
        extra = await a.register_region(RegionSpec("extra", BLOCKS, BLOCK, "bfloat16"))
        extra.tensor.copy_(a.regions.get("src").tensor)
        ids = list(range(300))
        spec = TransferSpec(peer=b.data_address, pairs=(("extra", "dst"),), src_blocks=Blocks.of(ids),
                            dst_blocks=Blocks.of(ids), codec="raw")
        assert (await a.wait(a.submit(spec).id, 10))["state"] == "done"
        assert a.mapper._views  # checked against the sender's regions, "extra" among them
        memory = weakref.ref(extra.tensor)
        del extra
        await a.delete_region("extra")
        gc.collect()
        assert memory() is None

    _run(body)
