"""What one peer message costs the receiver's event loop: ``python bench/message_cost.py``.

Starts a sidecar engine in this process, times its peer-message handler (it runs on the loop and
never awaits, so its time is the loop's stall) while a peer holding the secret sends hostile
messages of at most 64 KiB each: announces of the most ids, ranges, pairs and chunks a message can
name, against a region that exists and one that does not, chunks and replies for transfers that
do not exist. Prints the worst and median time per family, in milliseconds, and returns the
worst as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.engine import Engine, RegionSpec, Settings, peer  # noqa: E402
from kvferry.engine.blocks import Blocks, Range  # noqa: E402
from kvferry.transport.wire import Message, MessageType  # noqa: E402
from tests.rawpeer import RawPeer  # noqa: E402

LIMIT = 64 << 10
SECRET = "message-cost"


def families(region_blocks: int) -> dict[str, list[peer.Message]]:
    def announce(blocks: Blocks, pairs: int = 1, per_chunk: int = 1, region: str = "dst", inline: int = 0):
        return peer.Message(uuid.uuid4().hex, peer.Announce(
            "raw", "bfloat16", blocks, tuple(peer.PairLayout(region, (512,), per_chunk) for _ in range(pairs)),
            inline_chunks=inline))

    most_ids = (LIMIT - 200) // 4
    most_ranges = (LIMIT - 200) // 12
    return {
        "ids, region exists": [announce(Blocks(ids=tuple(range(most_ids)))) for _ in range(5)],
        "ids in range, region exists": [announce(Blocks(ids=tuple(range(min(most_ids, region_blocks)))))
                                        for _ in range(5)],
        "one range of 2^20": [announce(Blocks(ranges=(Range(0, 1 << 20, 1),))) for _ in range(5)],
        "ranges of 2^20 in all": [announce(Blocks(ranges=tuple(Range(i, (1 << 20) // most_ranges, 1)
                                                               for i in range(most_ranges)))) for _ in range(5)],
        "spread of 2^20": [announce(Blocks(ids=tuple(range(1024)), spread=(1024, 1))) for _ in range(5)],
        "1024 pairs, region exists": [announce(Blocks(ids=(0, 1)), pairs=1024) for _ in range(5)],
        "1024 pairs, no region": [announce(Blocks(ids=(0, 1)), pairs=1024, region="nowhere") for _ in range(5)],
        "1024 inline chunks promised": [announce(Blocks(ranges=(Range(0, region_blocks, 1),)), inline=1024)
                                        for _ in range(5)],
        "chunk of nothing": [peer.Message(uuid.uuid4().hex, peer.Chunk(0, bytes(LIMIT - 100))) for _ in range(20)],
        "replies of nothing": [peer.Message(uuid.uuid4().hex, body) for body in
                               (peer.Done(1, 2, 3), peer.Cancel("x"), peer.Error("E", "r"), peer.Written(1)) * 5],
    }


async def measure(region_blocks: int) -> dict[str, dict[str, float]]:
    engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp", peer_secret=SECRET))
    await engine.start()
    times: list[float] = []
    handler = engine.on_message

    def timed(connection, payload):
        started = time.perf_counter()
        try:
            handler(connection, payload)
        finally:
            times.append(time.perf_counter() - started)

    engine.on_message = timed
    engine.listener.on_message = timed
    await engine.register_region(RegionSpec("dst", region_blocks, (512,), "bfloat16"))
    raw = await RawPeer.connect(engine.data_address, SECRET.encode())
    out = {}
    try:
        for name, messages in families(region_blocks).items():
            times.clear()
            for message in messages:
                data = peer.pack(message)
                assert len(data) <= LIMIT, (name, len(data))
                await raw.send(Message(MessageType.MSG, length=len(data)), data)
            deadline = time.monotonic() + 30
            while len(times) < len(messages) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            out[name] = {"worst_ms": max(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
                         "messages": len(times)}
    finally:
        await raw.close()
        await engine.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--region-blocks", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.region_blocks))
    print("| message (≤ 64 KiB) | worst ms | median ms |\n|---|---:|---:|")
    for name, row in result.items():
        print(f"| {name} | {row['worst_ms']:.2f} | {row['median_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
