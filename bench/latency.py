"""One-block transfer latency between two real sidecars, submit to done.

    python bench/latency.py [--n 1000] [--long 10000] [--block-kib 64] [--codec raw] [--device cpu|cuda]
                            [--backend tcp|ucxx] [--dst-kind owned|shm] [--json]

Two ``kvferry serve`` processes on loopback; the sender's client submits one-block transfers one
after another with ``POST /v1/transfers?wait=`` (one HTTP call that answers once the receiver has
written the block). Reported per run:

- ``engine``: the sender's own record, submit to done (the receiver's DONE read back) — what the
  sidecars cost; and its stages (announced, accepted by the peer, first chunk sent, last chunk
  acknowledged, done), medians in ms since submit;
- ``client``: the HTTP call as the caller saw it (adds the control API's own cost);
- ``receiver``: submit at the sender to done at the receiver (one host, one clock): where a
  standing lease lets the sender write first and announce behind the data, the receiver is done
  one message after the write, as NIXL's target is on its notification.

``--dst-kind shm``: the destination is a POSIX shared-memory segment of this process (a worker's
host KV), which a same-host sender writes itself under a standing lease; ``owned`` (default): the
receiver's own memory (on a GPU sidecar, lent over CUDA IPC the same way; on the CPU the bytes
cross the data connection).

Then the same over ``--long`` transfers, whose first and last thousand are compared: a transfer
history that fills up must not make transfers slower. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.client import Client  # noqa: E402
from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready  # noqa: E402

STAGES = ("announced", "accepted", "first_byte", "last_byte", "done")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run(client: Client, peer: str, n: int, codec: str, receiver: Client | None = None) -> dict:
    engine_ms, client_ms, receiver_ms = [], [], []
    sent: dict[str, float] = {}  # transfer id -> created (wall clock) on the sender
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    for i in range(n):
        started = time.perf_counter()
        response = client._call("POST", "/v1/transfers", params={"wait": 10}, json={
            "src_region": "src", "dst_region": "dst", "src_blocks": [i % 8], "dst_blocks": [(i * 3) % 8],
            "peer": peer, "codec": codec})
        client_ms.append((time.perf_counter() - started) * 1e3)
        record = response.json()
        if record.get("state") != "done":
            raise RuntimeError(f"transfer {i} did not finish: {record}")
        engine_ms.append(record["seconds"] * 1e3)
        sent[record["id"]] = record["created"]
        for stage in STAGES:
            if stage in record["stages"]:
                stages[stage].append(record["stages"][stage] * 1e3)
    if receiver is not None:  # asked once afterwards: a query between transfers would slow the next one
        for incoming in receiver._call("GET", "/v1/transfers", params={"direction": "in", "limit": min(n, 10000)}).json():
            if incoming["id"] in sent and incoming["state"] == "done":
                receiver_ms.append((incoming["created"] + incoming["seconds"] - sent[incoming["id"]]) * 1e3)
    return {"n": n, "engine_ms": engine_ms, "client_ms": client_ms, "receiver_ms": receiver_ms,
            "path": record["choice_reason"],
            "stages_median_ms": {s: statistics.median(v) for s, v in stages.items() if v}}


def summary(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values), "p99_ms": percentile(values, 99),
            "p50_ms": percentile(values, 50), "min_ms": min(values), "max_ms": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--long", type=int, default=10000, help="then this many (0: skip)")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--codec", default="raw")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--dst-kind", default="owned", choices=("owned", "shm"))
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="KVFERRY_CPU_THREADS of both sidecars (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    import torch

    elements = args.block_kib * 1024 // 2
    ports = [(free_port(), free_port()) for _ in range(2)]
    env = {"KVFERRY_PEER_SECRET": "latency-bench", "KVFERRY_CPU_THREADS": str(args.cpu_threads)}
    processes = [start_sidecar(p, d, args.backend, env=env, device=args.device) for p, d in ports]
    keep = []
    try:
        sender, receiver = (Client(f"http://127.0.0.1:{p}", timeout=60) for p, _ in ports)
        for client, process in zip((sender, receiver), processes):
            wait_ready(client, process, timeout=120)
        data = (torch.randn(8, elements, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
        sender.region_from_tensor("src", data)
        if args.dst_kind == "shm":
            _, segment = receiver.region_from_tensor("dst", torch.zeros_like(data), kind="shm")
            keep.append(segment)
        else:
            receiver.create_region("dst", 8, [elements], "bfloat16")
        peer = receiver.data_address()
        run(sender, peer, 50, args.codec)  # warm-up: connection, code paths
        first = run(sender, peer, args.n, args.codec, receiver)
        result = {"device": args.device, "backend": args.backend, "codec": args.codec, "block_bytes": elements * 2,
                  "dst_kind": args.dst_kind,
                  "cpu_threads": args.cpu_threads,
                  "host": platform.node(), "cpu": platform.processor() or platform.machine(),
                  "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                  "n": first["n"], **summary(first["engine_ms"]),
                  "client": summary(first["client_ms"]), "stages_median_ms": first["stages_median_ms"],
                  "receiver": summary(first["receiver_ms"]) if first["receiver_ms"] else None,
                  "path": first["path"]}
        if args.long:
            long = run(sender, peer, args.long, args.codec)
            head, tail = long["engine_ms"][:1000], long["engine_ms"][-1000:]
            result["long"] = {"n": long["n"], **summary(long["engine_ms"]), "client": summary(long["client_ms"]),
                              "first_1000": summary(head), "last_1000": summary(tail)}
        result["bit_exact_spot_check"] = _spot_check(receiver, data)
        sender.close()
        receiver.close()
    finally:
        stop_sidecars(processes)
        for segment in keep:
            segment.close()
            segment.unlink()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvferry one-block latency: {result['block_bytes'] >> 10} KiB {args.codec}, {args.backend}, {args.device}, "
          f"destination {args.dst_kind}, "
          f"{result['date']}\n`{result['command']}`\n")
    print(f"{'run':<22}{'n':>7}{'median ms':>11}{'p99 ms':>9}{'client median':>15}{'client p99':>12}"
          f"{'receiver median':>17}{'receiver p99':>14}")
    rows = [("first", result)]
    if "long" in result:
        rows += [("long", result["long"]), ("long: first 1000", result["long"]["first_1000"]),
                 ("long: last 1000", result["long"]["last_1000"])]
    for name, row in rows:
        client, incoming = row.get("client", {}), row.get("receiver") or {}
        print(f"{name:<22}{row.get('n', 1000):>7}{row['median_ms']:>11.3f}{row['p99_ms']:>9.3f}"
              f"{client.get('median_ms', float('nan')):>15.3f}{client.get('p99_ms', float('nan')):>12.3f}"
              f"{incoming.get('median_ms', float('nan')):>17.3f}{incoming.get('p99_ms', float('nan')):>14.3f}")
    print(f"\npath: {result['path']}")
    print("stages, median ms since submit: " + ", ".join(f"{k} {v:.3f}" for k, v in result["stages_median_ms"].items()))
    return 0


def _spot_check(receiver: Client, data) -> bool:
    """The last transfers wrote source block i % 8 into destination block 3i % 8: every
    destination block holds one of the source blocks, bit for bit."""
    import torch

    sources = {data[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(8)}
    return all(receiver.get_block("dst", j) in sources for j in range(8))


if __name__ == "__main__":
    sys.exit(main())
