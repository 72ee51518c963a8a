"""The vLLM connector's core on a GPU, without vLLM: a prefill and a decode "worker" in this
process, each with a Llama-3-8B-shaped per-layer KV cache on the GPU as vLLM allocates it (32
layers of ``[2, blocks, 16, 8, 128]`` bf16 views into one buffer), registered with its own GPU
sidecar (CUDA IPC); each request replays the connector's hook sequence (save + lease on the
prefill, pull + get_finished polling + load on the decode) and is checked bit for bit.

Reported per request size: the time the decode waits for the KV (start of the pull to the pages
in its cache), the transfer's own time (the sender's record, submit to done), and the difference
(the connector's overhead: the HTTP call, polling, and with ``--layout mirror`` the device
gathers into and out of the mirror). The overhead's parts, on this host's wall clock: the pull's
start to its request sent, from there to the transfer's record created on the prefill's sidecar,
and from the transfer's end to its answer read on the decode's side. The transfer's end, split by the
two sidecars' records: from the sender's announce to the receiver's record, the receiver's own
time to done, and from there to the sender's done (its DONE on the way back).

    python bench/vllm_gpu_harness.py [--tokens 4096] [--requests 20] [--codec auto] [--backend tcp]
                                     [--layout in-place|mirror]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 32, 16, 8, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--poll-ms", type=float, default=0.5, help="get_finished interval (vLLM: every step)")
    parser.add_argument("--layout", choices=("in-place", "mirror"), default="in-place",
                        help="lend vLLM's cache itself (default) or a device mirror of it")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    from kvferry.client import Client
    from kvferry.client.vllm_core import ConnectorConfig, Consumer, KvCache, LoadSpec, Producer, remote_params
    from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    per_request = args.tokens // BLOCK_SIZE
    blocks = 2 * per_request + 16
    ports = [(free_port(), free_port()) for _ in range(2)]
    processes = [start_sidecar(p, d, args.backend, device=args.device, env={"KVFERRY_TRANSFER_TIMEOUT": "60"})
                 for p, d in ports]
    rows = []
    try:
        urls = [f"http://127.0.0.1:{p}" for p, _ in ports]
        for url, process in zip(urls, processes):
            wait_ready(Client(url), process, timeout=180)
        generator = torch.Generator(device=args.device).manual_seed(0)
        shape = (LAYERS, 2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
        p_buffer = (torch.randn(shape, generator=generator, device=args.device) * 0.7).to(torch.bfloat16)
        d_buffer = torch.zeros(shape, dtype=torch.bfloat16, device=args.device)
        p_layers, d_layers = list(p_buffer.unbind(0)), list(d_buffer.unbind(0))
        in_place = args.layout == "in-place"
        p_cache = KvCache(Client(urls[0]), "harness-prefill", p_layers, blocks, in_place=in_place)
        d_cache = KvCache(Client(urls[1]), "harness-decode", d_layers, blocks, in_place=in_place)
        p_config = ConnectorConfig(url=urls[0], codec=args.codec)
        producer = Producer(p_config, p_cache)
        consumer = Consumer(ConnectorConfig(url=urls[1], codec=args.codec), d_cache)
        for request in range(args.requests + 1):  # the first warms up
            order = torch.randperm(blocks, generator=torch.Generator().manual_seed(request)).tolist()
            src, dst = order[:per_request], order[per_request:2 * per_request]
            d_buffer.zero_()
            sync()
            rid = f"req-{request}"
            producer.save(rid, src)
            sync()
            started_wall = time.time()
            pull = consumer.start(LoadSpec(f"dec-{request}", tuple(dst), remote_params(rid, src, p_config)))
            if pull.error:
                raise RuntimeError(pull.error)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                received, failed = consumer.poll()
                if received or failed:
                    break
                time.sleep(args.poll_ms / 1e3)
            if failed or not received:
                raise RuntimeError(f"request {rid} did not load: {consumer.failed_blocks}")
            sync()
            ids_p, ids_d = torch.tensor(src, device=args.device), torch.tensor(dst, device=args.device)
            exact = torch.equal(p_buffer.index_select(2, ids_p).view(torch.int16),
                                d_buffer.index_select(2, ids_d).view(torch.int16))
            producer.finished_sending({rid})
            if request:
                stats = consumer.stats[-1]
                created = pull.record["created"]  # on the prefill's sidecar, this host's wall clock
                announced = created + (pull.record["stages"] or {}).get("announced", float("nan"))
                incoming = d_cache.client.transfer(pull.transfer_id)  # the decode sidecar's record of it
                received = incoming["created"] + incoming["seconds"]
                rows.append({**stats, "bit_exact": exact, "send_seconds": pull.asked_wall - started_wall,
                             "ask_seconds": created - pull.asked_wall,
                             "reply_seconds": pull.answered_wall - created - stats["transfer_seconds"],
                             "admit_seconds": incoming["created"] - announced,
                             "receive_seconds": incoming["seconds"],
                             "done_back_seconds": created + stats["transfer_seconds"] - received})
        p_cache.close()
        d_cache.close()
    finally:
        stop_sidecars(processes)
    wait = statistics.median(r["wait_seconds"] for r in rows)
    transfer = statistics.median(r["transfer_seconds"] for r in rows)
    overhead = statistics.median(r["wait_seconds"] - r["transfer_seconds"] for r in rows)
    nbytes = rows[0]["bytes_raw"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"vLLM connector core, {device}, {time.strftime('%Y-%m-%d')}: {args.tokens} tokens of Llama-3-8B KV "
          f"({nbytes / 2**20:.0f} MiB, {LAYERS} layers) per request, codec {args.codec}, {args.layout}, {len(rows)} requests\n"
          f"`{' '.join(sys.argv)}`\n")
    answer = statistics.median(r["answer_seconds"] for r in rows)
    load = statistics.median(r["load_seconds"] for r in rows)
    print("| decode waits (median) | transfer (median) | overhead (median of differences) | its answer in "
          "| load into vLLM's cache | codec chosen | bit-exact |")
    print("|---:|---:|---:|---:|---:|---|---|")
    print(f"| {wait * 1e3:.2f} ms | {transfer * 1e3:.2f} ms | {overhead * 1e3:.2f} ms | {answer * 1e3:.2f} ms | "
          f"{load * 1e3:.2f} ms | {rows[-1]['codec']} | {'all' if all(r['bit_exact'] for r in rows) else 'NO'} |")
    stages = {k: statistics.median(r["stages"][k] for r in rows if k in (r["stages"] or {})) * 1e3
              for k in rows[0]["stages"] or {}}
    split = {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("send_seconds", "ask_seconds", "reply_seconds")}
    print(f"the overhead's parts, median ms: from the pull's start to its request sent {split['send_seconds']:.2f}, "
          f"from there to the transfer's start {split['ask_seconds']:.2f}, "
          f"from the transfer's end to its answer {split['reply_seconds']:.2f}")
    print("transfer stages, median ms since submit: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    end = {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("admit_seconds", "receive_seconds",
                                                                    "done_back_seconds")}
    print(f"the transfer's end, median ms: from its announce to the receiver's record {end['admit_seconds']:.2f}, "
          f"to the receiver's done {end['receive_seconds']:.2f}, to the sender's done {end['done_back_seconds']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
