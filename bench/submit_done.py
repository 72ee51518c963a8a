"""Submit → done for one small transfer (one 4 KiB block between two sidecars on this host), over
HTTP and over gRPC in the same run, the ways taken in turn so that both see the same host load:

- HTTP, ``Client.send``: the blocking SDK, one call that answers at the transfer's end (what the
  vLLM connector sends without gRPC);
- HTTP, ``AsyncClient.submit(wait=)``: the same call from asyncio;
- gRPC, ``GrpcClient.submit(wait=)``: one Submit that answers at the end;
- gRPC, ``GrpcSender.send``: the same Submit from the blocking client, read on the calling thread
  (no hop through an event loop or another thread), as ``Client.send`` is over HTTP;
- gRPC, ``GrpcSender.start`` + ``Watched.end``: one ``SubmitAndWatch`` stream, the started record
  then the end, read on the calling thread;
- gRPC, ``Submit`` + Watch: Submit answers at once and the end comes by a long-lived
  ``Watch(mine, follow)`` stream read by ``GrpcClient`` on its event loop.

    python bench/submit_done.py [--n 500] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = [2048]  # bfloat16: 4 KiB a block


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e6

    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": at(0.9), "p99_us": at(0.99), "n": len(ordered)}


async def measure(n: int, rest: str, target: str, peer: str) -> dict[str, list[float]]:
    from kvferry.client import AsyncClient, Client
    from kvferry.client.grpc import GrpcClient, GrpcSender

    sync, aio = Client(rest, timeout=30), AsyncClient(rest, timeout=30)
    grpc_wait_client, watching = GrpcClient(target, timeout=30), GrpcClient(target, timeout=30)
    sender = GrpcSender(target, timeout=30)
    ends: dict[str, asyncio.Future] = {}  # transfer id -> its end, from the watching client's stream

    def end_of(transfer_id: str) -> asyncio.Future:
        return ends.setdefault(transfer_id, asyncio.get_running_loop().create_future())

    async def watch() -> None:
        async for event in watching.watch(mine=True, follow=True):
            if event.status is not None and event.status.terminal and not end_of(event.id).done():
                end_of(event.id).set_result(event.status)

    async def pushed() -> str:
        transfer_id = await watching.submit("kv", [0], peer, "kv", [1])
        await end_of(transfer_id)
        del ends[transfer_id]
        return transfer_id

    async def http_sync() -> str:
        return sync.send("kv", [0], peer, "kv", [1], wait=10)["id"]

    async def http_async() -> str:
        return await aio.submit("kv", [0], peer, "kv", [1], wait=10)

    async def grpc_sender() -> str:
        return sender.send("kv", [0], peer, "kv", [1], wait=10)["id"]

    async def grpc_stream() -> str:
        watched = sender.start("kv", [0], peer, "kv", [1], wait=10)
        return watched.end()["id"]

    async def grpc_wait() -> str:
        return await grpc_wait_client.submit("kv", [0], peer, "kv", [1], wait=10)

    ways = {"HTTP, Client.send (answers at the end)": http_sync,
            "HTTP, AsyncClient.submit(wait)": http_async,
            "gRPC, GrpcClient.submit(wait)": grpc_wait,
            "gRPC, GrpcSender.send (blocking)": grpc_sender,
            "gRPC, SubmitAndWatch read by GrpcSender (blocking)": grpc_stream,
            "gRPC, Submit + end pushed by Watch(mine, follow)": pushed}
    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.2)  # the stream is subscribed
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(n):
            for name, way in ways.items():
                started = time.perf_counter()
                transfer_id = await way()
                seconds[name].append(time.perf_counter() - started)
                state = sync.transfer(transfer_id)["state"]  # not timed: each one did end done
                if state != "done":
                    raise RuntimeError(f"{name}: transfer {transfer_id} is {state}")
    finally:
        watcher.cancel()
        sync.close()
        await aio.aclose()
        await grpc_wait_client.aclose()
        sender.close()
        await watching.aclose()
    return {name: values[n // 10:] for name, values in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=500, help="transfers each way (the first tenth warms up)")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from kvferry.client import Client
    from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

    ports = [(free_port(), free_port(), free_port()) for _ in range(2)]
    processes = [start_sidecar(p, d, args.backend, extra=["--grpc-port", str(g)]) for p, d, g in ports]
    try:
        clients = [Client(f"http://127.0.0.1:{p}", timeout=30) for p, _, _ in ports]
        for client, process in zip(clients, processes):
            wait_ready(client, process, timeout=120)
            client.create_region("kv", 4, BLOCK, "bfloat16")
        peer = clients[1].data_address()
        seconds = asyncio.run(measure(args.n, f"http://127.0.0.1:{ports[0][0]}", f"127.0.0.1:{ports[0][2]}", peer))
        for client in clients:
            client.close()
    finally:
        stop_sidecars(processes)
    rows = {name: summary(values) for name, values in seconds.items()}
    print(f"submit -> done, one 4 KiB transfer between two sidecars on this host, {time.strftime('%Y-%m-%d')}\n"
          f"`{' '.join(sys.argv)}`\n\n| way | median µs | p90 µs | p99 µs |\n|---|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_us']:.0f} | {row['p90_us']:.0f} | {row['p99_us']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
