"""Announces that cost more than their bytes, and transfers that never end: a peer (buggy or
hostile, holding the secret) announces absurd sizes, or announces and in the same write cancels,
sends a chunk nobody announced, initial-credit data of the wrong size, or data it has no credit
for. The receiver answers at once,
every such transfer ends, its region can be deleted, and the sidecar's own transfers still run."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from kvferry.engine import peer
from kvferry.engine.blocks import Blocks, Range
from kvferry.transport.wire import Message, MessageType
from tests.engine.conftest import spawn, stop
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow
SECRET = "hostile-announces"


def _announce(transfer_id: str, blocks: Blocks, per_chunk: int = 1, inline: int = 0, region: str = "dst",
              codec: str = "raw", dtype: str = "bfloat16") -> peer.Message:
    return peer.Message(transfer_id, peer.Announce(codec, dtype, blocks, (peer.PairLayout(region, (512,), per_chunk),),
                                                   inline_chunks=inline))


def _msg(raw: RawPeer, body: peer.Message) -> bytes:
    data = peer.pack(body)
    return raw.seal(Message(MessageType.MSG, length=len(data)), data)


def _record(client, transfer_id: str, timeout: float = 10.0) -> dict:
    """The receiver's record once it exists and is no longer running (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    record = {}
    while time.monotonic() < deadline:
        try:
            record = client.transfer(transfer_id)
        except Exception:
            time.sleep(0.05)
            continue
        if record["state"] != "running":
            return record
        time.sleep(0.05)
    return record


@pytest.fixture(scope="module")
def daemon():
    daemon = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "30", "KVFERRY_PEER_SECRET": SECRET})
    yield daemon
    stop(daemon)


@pytest.fixture
def receiver(daemon):
    daemon.client.create_region("dst", 8, [512], "bfloat16")
    yield daemon
    try:
        daemon.client.delete_region("dst")
    except Exception:
        pass


@pytest.mark.parametrize("blocks", [Blocks(ranges=(Range(0, 1 << 20, 1),)),
                                    Blocks(ranges=(Range(0, (1 << 32) - 1, 1),)),
                                    Blocks(ranges=tuple(Range(0, 1 << 20, 1) for _ in range(64)))],
                         ids=["2^20 ids", "2^32-1 ids", "64 x 2^20 ids"])
@pytest.mark.parametrize("region", ["dst", "nowhere"])
def test_a_huge_announce_is_answered_at_once_and_the_daemon_stays_responsive(receiver, blocks, region):
    async def main():
        raw = await RawPeer.connect(receiver.data, SECRET.encode())
        try:
            started = time.monotonic()
            transfer_id = uuid.uuid4().hex
            await raw.link.send(_msg(raw, _announce(transfer_id, blocks, region=region)))
            health = await asyncio.to_thread(httpx.get, f"{receiver.url}/healthz", timeout=5)
            assert health.status_code == 200
            if sum(r.count for r in blocks.ranges) <= peer.MAX_IDS:  # parsed, refused with a reason
                message, payload = await asyncio.wait_for(raw.recv(), 5)
                reply = peer.unpack(payload)
                assert isinstance(reply.body, peer.Reject) and reply.transfer_id == transfer_id
            return time.monotonic() - started
        finally:
            await raw.close()

    took = asyncio.run(main())
    assert took < 5
    receiver.client.delete_region("dst")  # nothing was left holding it


@pytest.mark.parametrize("follow", ["cancel", "bad chunk", "initial-credit data of the wrong size", "nothing, then the link goes"])
def test_a_transfer_aborted_in_the_announces_own_write_ends(receiver, follow):
    transfer_id = uuid.uuid4().hex

    async def main():
        raw = await RawPeer.connect(receiver.data, SECRET.encode())
        announce = _msg(raw, _announce(transfer_id, Blocks(ids=(0, 1)), per_chunk=1))
        if follow == "cancel":
            extra = _msg(raw, peer.Message(transfer_id, peer.Cancel("changed my mind")))
        elif follow == "bad chunk":
            extra = _msg(raw, peer.Message(transfer_id, peer.Chunk(7, b"junk")))
        elif follow == "initial-credit data of the wrong size":
            tag = peer.chunk_tag(transfer_id, 0)
            extra = raw.seal(Message(MessageType.DATA, tag, 0, 4, 1 << 30), b"abcd")
        else:
            extra = b""
        await raw.link.send(announce + extra)
        await asyncio.sleep(0.5)
        await raw.close()

    asyncio.run(main())
    record = _record(receiver.client, transfer_id)
    assert record and record["state"] in ("failed", "cancelled"), record
    receiver.client.delete_region("dst")  # not held by a transfer that never ends


@pytest.mark.parametrize("inline", [0, 1], ids=["streamed", "inline"])
def test_a_codec_that_cannot_code_the_regions_dtype_is_refused_at_once(daemon, inline):
    """tca-tbe codes bfloat16 only: into a float16 region, the announce is refused with a reason,
    not admitted to fail in its receive buffers' sizing (and stay running, holding the region)."""
    daemon.client.create_region("half", 8, [512], "float16")
    transfer_id = uuid.uuid4().hex

    async def main():
        raw = await RawPeer.connect(daemon.data, SECRET.encode())
        try:
            await raw.link.send(_msg(raw, _announce(transfer_id, Blocks(ids=(0, 1)), inline=inline, region="half",
                                                    codec="tca-tbe", dtype="float16")))
            message, payload = await asyncio.wait_for(raw.recv(), 5)
            reply = peer.unpack(payload)
            assert isinstance(reply.body, peer.Reject) and reply.transfer_id == transfer_id
            assert reply.body.error == "BadRequest" and "tca-tbe" in reply.body.reason
        finally:
            await raw.close()

    try:
        asyncio.run(main())
        assert all(t["state"] != "running" for t in daemon.client.transfers(direction="in"))
    finally:
        daemon.client.delete_region("half")  # not held by a transfer that never ends


def test_silent_announces_neither_stay_running_nor_lock_out_the_sidecars_own_transfers():
    a = spawn("tcp", {"KVFERRY_PEER_SECRET": SECRET})
    b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "4", "KVFERRY_PEER_SECRET": SECRET,
                      "KVFERRY_MAX_INCOMING_TRANSFERS": "8", "KVFERRY_MAX_INCOMING_TRANSFERS_PER_PEER": "8"})
    try:
        b.client.create_region("dst", 8, [512], "bfloat16")
        b.client.create_region("src", 8, [512], "bfloat16")
        a.client.create_region("dst", 8, [512], "bfloat16")
        ids = [uuid.uuid4().hex for _ in range(16)]

        async def main():
            raw = await RawPeer.connect(b.data, SECRET.encode())
            await raw.link.send(b"".join(_msg(raw, _announce(i, Blocks(ids=(0,)), per_chunk=1)) for i in ids))
            await asyncio.sleep(0.5)
            return raw

        raw = asyncio.run(main())
        # The peer's announces fill only the incoming budget: this sidecar's own transfer runs.
        transfer = b.client.submit("src", [0, 1], a.data, "dst", [0, 1], codec="raw")
        assert b.client.wait(transfer, timeout=30)["state"] == "done"
        deadline = time.monotonic() + 15  # the refused ones have no record: only the taken ones are waited for
        while True:
            states = [t["state"] for t in b.client.transfers(direction="in") if t["id"] in ids]
            if states and "running" not in states or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(states) == 8 and all(s in ("failed", "cancelled") for s in states), states
        asyncio.run(raw.close())
    finally:
        stop(a, b)


def test_chunks_move_only_on_credits(receiver):
    """A receiver admitting a streamed announce grants the first two transport chunks buffers
    silently (the initial credit) and the next ones by CTS sent unasked, one for each chunk's
    buffer, a window past the last chunk taken; DATA for a chunk it granted nothing lands nowhere
    and is refused by name."""
    from kvferry.engine.incoming import credit_ahead
    from kvferry.engine.settings import Settings

    transfer_id = uuid.uuid4().hex
    tags = [peer.chunk_tag(transfer_id, i) for i in range(8)]
    window = credit_ahead(Settings())

    async def main():
        raw = await RawPeer.connect(receiver.data, SECRET.encode())
        try:
            await raw.link.send(_msg(raw, _announce(transfer_id, Blocks(ids=tuple(range(8))))))
            credits, accepted = [], False
            while not accepted or len(credits) < window - peer.EAGER_CHUNKS:
                message, payload = await asyncio.wait_for(raw.recv(), 5)
                if message.type == MessageType.CTS:
                    credits.append(message.tag)
                    assert message.total >= 1024  # a block's buffer, at least
                else:
                    assert message.type == MessageType.MSG
                    accepted = isinstance(peer.unpack(payload).body, peer.Accept)
            assert credits == tags[peer.EAGER_CHUNKS:window]
            with pytest.raises(TimeoutError):  # nothing more comes unasked
                await asyncio.wait_for(raw.recv(), 0.3)
            await raw.send(Message(MessageType.DATA, tags[7], 0, 16, 16), b"\xff" * 16)
            message, payload = await asyncio.wait_for(raw.recv(), 5)
            assert message.type == MessageType.REJECT and message.tag == tags[7]
            assert b"no receive posted" in payload
        finally:
            await raw.close()

    asyncio.run(main())
    record = _record(receiver.client, transfer_id)
    assert record["state"] == "failed", record  # the sender went away mid-transfer
    assert all(receiver.client.get_block("dst", b) == bytes(1024) for b in range(8))
