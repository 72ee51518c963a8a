"""A fuzzer of the binary peer protocol, bounded in time: a peer holding the secret (so its
messages pass authentication and reach the parsers) sends mutated announces, chunks, replies and
transport messages, many in one write. Afterwards the daemon answers at once, no transfer stays
running past its timeout, and a real transfer is still done bit for bit."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
import uuid

import httpx
import pytest
import torch

from kvferry.engine import peer
from kvferry.engine.blocks import Blocks, Range
from kvferry.transport import TransportError, wire
from kvferry.transport.wire import Message, MessageType
from tests.engine.conftest import spawn, stop
from tests.rawpeer import RawPeer

pytestmark = pytest.mark.slow
SECRET = "fuzz"
SECONDS = float(os.environ.get("KVFERRY_FUZZ_SECONDS", "15"))


def _valid(rng: random.Random, transfer_id: str) -> peer.Message:
    blocks = rng.choice([Blocks(ids=tuple(rng.randrange(0, 10) for _ in range(rng.randrange(1, 5)))),
                         Blocks(ranges=(Range(rng.randrange(0, 8), rng.randrange(1, 1 << 20), rng.choice([1, -1, 3])),)),
                         Blocks(ids=(rng.randrange(0, 4),), spread=(rng.randrange(1, 4), rng.choice([1, 2])))])
    kind = rng.randrange(8)
    if kind < 3:
        return peer.Message(transfer_id, peer.Announce(
            rng.choice(["raw", "splitzip", "entropy", "nope"]), rng.choice(["bfloat16", "float16", "int8"]), blocks,
            tuple(peer.PairLayout(rng.choice(["dst", "x" * rng.randrange(1, 200)]), (rng.choice([512, 256, 0]),),
                                  rng.randrange(1, 1 << 16)) for _ in range(rng.randrange(1, 4))),
            inline_chunks=rng.choice([0, 1, 2, 1 << 31]), flags=rng.choice([0, 1, 2, 3]),
            host=rng.choice([bytes(16), os.urandom(16)])))
    bodies = [peer.Chunk(rng.randrange(0, 4), os.urandom(rng.randrange(0, 3000))), peer.Done(1, 2, 3),
              peer.Cancel("x"), peer.Error("E", "r"), peer.Written(rng.randrange(0, 5)),
              peer.Accept((peer.Target(os.urandom(64), rng.randrange(0, 1 << 40), os.urandom(16), 7),)),
              peer.Revoke("dst"), peer.Revoked("dst")]
    return peer.Message(transfer_id, rng.choice(bodies))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(0, 4)):
        choice = rng.randrange(4)
        if choice == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 1 and len(data) > 24:
            del data[rng.randrange(24, len(data)):]
        elif choice == 2:
            data += os.urandom(rng.randrange(1, 16))
        elif len(data) > 30:
            at = rng.randrange(24, len(data) - 4)
            data[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 0xFFFFFFFF, 1 << 20, 1 << 31]))
    return bytes(data)


def _transport_noise(rng: random.Random, raw: RawPeer, ids: list[str]) -> bytes:
    tag = peer.chunk_tag(rng.choice(ids), rng.randrange(0, 3)) if ids and rng.random() < 0.7 else rng.getrandbits(64)
    kind = rng.choice([MessageType.RTS, MessageType.DATA, MessageType.ACK, MessageType.CTS, MessageType.REJECT])
    total = rng.choice([0, 4, 1000, 1 << 30])
    if kind == MessageType.DATA:
        length = rng.randrange(0, 64)
        offset = rng.randrange(0, max(1, total - length + 1)) if total >= length else 0
        total = max(total, offset + length)
        return raw.seal(Message(kind, tag, offset, length, total), os.urandom(length))
    if kind == MessageType.REJECT:
        return raw.seal(Message(kind, tag, length=3), b"why")
    return raw.seal(Message(kind, tag, total=total, length=rng.randrange(0, 1 << 20) if kind == MessageType.ACK else 0,
                            flags=rng.choice([0, 0x2, wire.FLAG_DONE]) if kind != MessageType.CTS else 0))


def test_fuzzed_peer_messages_leave_the_daemon_live_and_correct():
    b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "3", "KVFERRY_PEER_SECRET": SECRET})
    a = spawn("tcp", {"KVFERRY_PEER_SECRET": SECRET})
    rng = random.Random(int(os.environ.get("KVFERRY_FUZZ_SEED", "1")))
    try:
        b.client.create_region("dst", 8, [512], "bfloat16")

        async def fuzz() -> tuple[int, float]:
            sent, worst = 0, 0.0
            deadline = time.monotonic() + SECONDS
            raw, ids = None, []
            while time.monotonic() < deadline:
                if raw is None:
                    raw = await RawPeer.connect(b.data, SECRET.encode())
                batch = []
                for _ in range(rng.randrange(1, 20)):
                    if rng.random() < 0.25:
                        batch.append(_transport_noise(rng, raw, ids))
                        continue
                    transfer_id = rng.choice(ids) if ids and rng.random() < 0.5 else uuid.uuid4().hex
                    ids = (ids + [transfer_id])[-32:]
                    data = peer.pack(_valid(rng, transfer_id))
                    data = _mutate(rng, data) if rng.random() < 0.5 else data
                    batch.append(raw.seal(Message(MessageType.MSG, length=len(data)), data))
                try:
                    await raw.link.send(b"".join(batch))
                except TransportError:
                    raw = None
                    continue
                sent += len(batch)
                started = time.monotonic()
                health = await asyncio.to_thread(httpx.get, f"{b.url}/healthz", timeout=10)
                assert health.status_code == 200
                worst = max(worst, time.monotonic() - started)
                if rng.random() < 0.1:
                    await raw.close()
                    raw = None
            if raw is not None:
                await raw.close()
            return sent, worst

        sent, worst = asyncio.run(fuzz())
        assert sent > 100 and worst < 2, (sent, worst)
        deadline = time.monotonic() + 3 + 10
        while time.monotonic() < deadline:
            running = b.client.transfers(state="running")
            if not running:
                break
            time.sleep(0.2)
        assert not b.client.transfers(state="running")  # every transfer the fuzz began has ended
        kv = torch.randn(8, 512, dtype=torch.bfloat16)
        a.client.region_from_tensor("src", kv)
        transfer = a.client.submit("src", range(8), b.data, "dst", range(8), codec="raw")
        assert a.client.wait(transfer, timeout=30)["state"] == "done"
        got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("dst", i)), dtype=torch.bfloat16)
                           for i in range(8)])
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
    finally:
        stop(a, b)
