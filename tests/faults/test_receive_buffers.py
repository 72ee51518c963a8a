"""A peer names how many blocks each of a transfer's chunks holds, and the receiver sizes its
receive buffers by that: a chunk over the protocol's limit is refused before anything is
allocated, and a transfer whose buffers cannot be allocated fails at once (its region can be
deleted), instead of staying admitted with nobody to end it. One real engine in this process, a
hand-driven peer holding the secret."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from kvferry.engine import Engine, RegionSpec, Settings, peer
from kvferry.engine.blocks import Blocks, Range
from kvferry.engine.errors import NotFound
from kvferry.transport.wire import MessageType
from tests.rawpeer import RawPeer

SECRET = "receive-buffers"
BLOCK = (8192,)  # bf16: 16 KiB a block
BLOCKS = 8


def _announce(transfer_id: str, per_chunk: int) -> peer.Message:
    return peer.Message(transfer_id, peer.Announce("raw", "bfloat16", Blocks(ranges=(Range(0, BLOCKS, 1),)),
                                                   (peer.PairLayout("dst", BLOCK, per_chunk),)))


async def _reply(raw: RawPeer, transfer_id: str) -> peer.Message:
    while True:
        message, payload = await asyncio.wait_for(raw.recv(), 5)
        if message.type == MessageType.MSG:
            reply = peer.unpack(payload)
            if reply.transfer_id == transfer_id:
                return reply


def _run(body, monkeypatch, chunk_limit: int = 4 * BLOCK[0] * 2):  # four blocks a chunk, at most
    monkeypatch.setattr(peer, "MAX_CHUNK_BYTES", chunk_limit, raising=False)

    async def main():
        engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", transfer_timeout=20,
                                 peer_secret=SECRET))
        await engine.start()
        try:
            await engine.register_region(RegionSpec("dst", BLOCKS, BLOCK, "bfloat16"))
            raw = await RawPeer.connect(engine.data_address, SECRET.encode())
            try:
                await body(engine, raw)
            finally:
                await raw.close()
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_chunks_over_the_limit_are_refused_before_anything_is_allocated(monkeypatch):
    async def body(engine, raw):
        taken = []
        take = engine.buffers.take
        monkeypatch.setattr(engine.buffers, "take", lambda n, device: taken.append(n) or take(n, device))
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(_announce(transfer_id, per_chunk=0xFFFFFFFF))
        reply = await _reply(raw, transfer_id)
        assert isinstance(reply.body, peer.Reject) and "over the protocol's" in reply.body.reason, reply
        assert taken == []
        accepted = uuid.uuid4().hex  # at the limit: admitted, its buffers no larger than a chunk
        await raw.send_peer(_announce(accepted, per_chunk=4))
        await asyncio.sleep(0.2)
        assert engine.transfers.get(accepted).state.value == "running"
        assert taken and max(taken) <= peer.MAX_CHUNK_BYTES + 4096, taken  # + a frame's header

    _run(body, monkeypatch)


def test_a_transfer_whose_buffers_cannot_be_allocated_fails_and_frees_its_region(monkeypatch):
    async def body(engine, raw):
        def out_of_memory(nbytes, device):
            raise torch.OutOfMemoryError(f"cannot allocate {nbytes} bytes")

        monkeypatch.setattr(engine.buffers, "take", out_of_memory)  # a GPU the worker has filled
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(_announce(transfer_id, per_chunk=4))
        reply = await _reply(raw, transfer_id)
        assert isinstance(reply.body, peer.Error) and reply.body.error == "InsufficientStorage", reply
        record = engine.transfers.get(transfer_id)
        assert record.state.value == "failed" and record.error_kind == "InsufficientStorage"
        await engine.delete_region("dst")
        with pytest.raises(NotFound):
            engine.regions.get("dst")

    _run(body, monkeypatch)


def test_an_inline_chunk_larger_than_a_sender_inlines_is_refused(monkeypatch):
    """Inline chunks are decoded on the event loop as they are read, so they are held to the size
    a sender inlines: a peer cannot have the loop decode a region-sized chunk."""
    async def body(engine, raw):
        await engine.register_region(RegionSpec("big", 64, BLOCK, "bfloat16"))  # 1 MiB
        transfer_id = uuid.uuid4().hex
        await raw.send_peer(peer.Message(transfer_id, peer.Announce(
            "raw", "bfloat16", Blocks(ranges=(Range(0, 64, 1),)), (peer.PairLayout("big", BLOCK, 64),),
            inline_chunks=1)))
        reply = await _reply(raw, transfer_id)
        assert isinstance(reply.body, peer.Reject) and reply.body.error == "ProtocolViolation", reply
        assert "inline chunk 0" in reply.body.reason
        small = uuid.uuid4().hex  # what a sender inlines: one 16 KiB block, admitted
        await raw.send_peer(peer.Message(small, peer.Announce(
            "raw", "bfloat16", Blocks.of([3]), (peer.PairLayout("big", BLOCK, 1),), inline_chunks=1)))
        await asyncio.sleep(0.2)
        assert engine.transfers.get(small).state.value == "running"

    _run(body, monkeypatch, chunk_limit=1 << 30)
