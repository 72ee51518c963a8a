"""More senders than a receiver takes at once (``max_incoming_transfers``): the receiver refuses
the announces beyond its budget before anything is written, the senders' records say
``Overloaded``, and a client waiting for the end sends such a transfer again: every one ends done.
One peer alone cannot take the whole budget (``max_incoming_transfers_per_peer``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

import pytest
import torch

from kvferry.engine import peer
from kvferry.engine.blocks import Blocks
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow


def test_transfers_refused_as_overloaded_are_sent_again_and_done():
    b = spawn("tcp", {"KVFERRY_MAX_INCOMING_TRANSFERS": "1"})
    senders = [spawn("tcp") for _ in range(2)]
    try:
        kv = torch.randn(64, 1024, dtype=torch.bfloat16)
        b.client.create_region("dst", 64 * 4, [1024], "bfloat16")
        for s in senders:
            s.client.region_from_tensor("src", kv)

        def send(i: int) -> dict:
            s = senders[i % 2]
            return s.client.send("src", range(64), b.data, "dst", range(64 * (i % 4), 64 * (i % 4) + 64),
                                 codec="raw", wait=60)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            records = list(pool.map(send, range(8)))
        assert [r["state"] for r in records] == ["done"] * 8, [(r["state"], r["error"]) for r in records]
        got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("dst", i)), dtype=torch.bfloat16)
                           for i in range(64)])
        assert bits_equal(got, kv)
        refused = [t for t in b.client.transfers(direction="in") if t["state"] == "failed"]
        assert not refused  # a refusal is not a transfer the receiver took on
    finally:
        stop(b, *senders)


def test_a_transfer_given_its_id_is_not_sent_again_under_it():
    """``send_later`` with a caller's id: refused as Overloaded, the answer is that refusal, naming
    the id, which now names a failed record; no second submit under it is made (it would be a
    Conflict, and hide the refusal)."""
    from kvferry.engine.errors import Conflict, TransferFailed

    b = spawn("tcp", {"KVFERRY_MAX_INCOMING_TRANSFERS": "1"})
    a = spawn("tcp")
    try:
        kv = torch.randn(64, 1024, dtype=torch.bfloat16)
        b.client.create_region("dst", 64 * 8, [1024], "bfloat16")
        a.client.region_from_tensor("src", kv)
        ids = [uuid.uuid4().hex for _ in range(8)]

        def send(i: int) -> str:
            answer = a.client.send_later("src", range(64), b.data, "dst", range(64 * i, 64 * i + 64), codec="raw",
                                         wait=60, transfer_id=ids[i])
            try:
                return answer.result()["state"]
            except TransferFailed as exc:
                assert not isinstance(exc, Conflict) and exc.kind == "Overloaded", exc
                return "overloaded"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            states = list(pool.map(send, range(8)))
        assert set(states) == {"done", "overloaded"}, states  # eight at once into a budget of one
        for i, state in enumerate(states):
            assert a.client.transfer(ids[i])["state"] == ("done" if state == "done" else "failed")
    finally:
        stop(a, b)


def test_one_flooding_peer_cannot_take_every_incoming_slot():
    """A peer (holding the secret) that announces transfers and never sends them gets as many
    taken on as ``max_incoming_transfers_per_peer``; the rest are refused as Overloaded (a sender
    retries those), and a transfer from another peer is still taken on and done."""
    secret = "per-peer"
    b = spawn("tcp", {"KVFERRY_PEER_SECRET": secret, "KVFERRY_MAX_INCOMING_TRANSFERS": "8",
                      "KVFERRY_MAX_INCOMING_TRANSFERS_PER_PEER": "2", "KVFERRY_TRANSFER_TIMEOUT": "30"})
    a = spawn("tcp", {"KVFERRY_PEER_SECRET": secret})
    try:
        b.client.create_region("dst", 8, [512], "bfloat16")
        a.client.create_region("src", 8, [512], "bfloat16")

        async def flood() -> tuple[RawPeer, list[peer.Message]]:
            raw = await RawPeer.connect(b.data, secret.encode(), source="127.0.0.2")  # another host
            for i in range(6):
                announce = peer.Announce("raw", "bfloat16", Blocks(ids=(i,)), (peer.PairLayout("dst", (512,), 1),))
                await raw.send_peer(peer.Message(uuid.uuid4().hex, announce))
            replies = [peer.unpack((await asyncio.wait_for(raw.recv(), 5))[1]) for _ in range(6)]
            return raw, replies

        raw, replies = asyncio.run(flood())
        refused = [r.body for r in replies if isinstance(r.body, peer.Reject)]
        assert sum(isinstance(r.body, peer.Accept) for r in replies) == 2
        assert len(refused) == 4 and all(r.error == "Overloaded" and "per_peer" in r.reason for r in refused), refused
        flooding = [t for t in b.client.transfers(direction="in") if t["state"] == "running"]
        assert len(flooding) == 2
        # The flooder holds its two slots still; another peer's transfer is taken on and done.
        record = a.client.send("src", [0, 1], b.data, "dst", [6, 7], codec="raw", wait=30)
        assert record["state"] == "done", record
        asyncio.run(raw.close())
    finally:
        stop(a, b)
