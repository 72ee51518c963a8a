"""The vLLM connector's core on a GPU, without vLLM: a prefill and a decode "worker" in this
process, each with a Llama-3-8B-shaped per-layer KV cache on the GPU as vLLM allocates it (32
layers of ``[2, blocks, 16, 8, 128]`` bf16 views into one buffer), registered with its own GPU
sidecar (CUDA IPC); each request replays the connector's hook sequence (save + lease on the
prefill, pull + get_finished polling + load on the decode) and is checked bit for bit.

Reported per request size: the time the decode waits for the KV (start of the pull to the pages
in its cache), the transfer's own time (the sender's record, submit to done), and the difference
(the connector's overhead: the HTTP call, polling, and with ``--layout mirror`` the device
gathers into and out of the mirror). The decode pulls once the prefill's lease is held, as a real
decode asks only after the proxy's hop (``--pull-after save`` races the lease thread instead, and
counts the lease's taking as overhead); the lease's time after the save is reported apart. The overhead's parts, on this host's wall clock: the pull's
start to its request sent, from there to the transfer's record created on the prefill's sidecar,
and from the transfer's end to its answer read on the decode's side. The transfer's end, split by the
two sidecars' records: from the sender's announce to the receiver's record, the receiver's own
time to done, and from there to the sender's done (its DONE on the way back).

With ``--control http,grpc`` (the default) one run measures both ways the decode learns a
transfer's end, request by request in turn on the same sidecars and caches: over HTTP, a long-poll
of the decode's own sidecar, which records the KV arrived before the prefill's hears the DONE;
over gRPC, a ``Watch`` of that one transfer on the same sidecar (``kvferry.client.vllm_watch``). Each is
reported apart (median and p90), with "answer after the end" the time from the transfer's end on
the prefill's sidecar (its record: submit to DONE) to the decode's worker thread holding a record
of the end, which may come first (negative), and apart from the receiver's done.

    python bench/vllm_gpu_harness.py [--tokens 4096] [--requests 20] [--codec auto] [--backend tcp]
                                     [--layout in-place|mirror] [--control http,grpc] [--device cuda|cpu]
                                     [--devices cuda:0,cuda:1] [--step-ms 5] [--pull-from step|worker]

``--step-ms`` has the decode's thread run Python between polls, as a busy vLLM step does, instead
of sleeping: it holds the interpreter lock, so whatever the connector leaves to its worker thread
waits up to the interpreter's switch interval (5 ms). ``--pull-from worker`` sends every pull from
that thread, the A/B of the connector sending it from the step where it can.
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


CONTROLS = {"http": "http", "grpc": "auto"}  # a path's name -> the connector's control setting


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=20, help="per control path")
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--devices", help="the prefill's and the decode's device, comma-separated (e.g. "
                                          "cuda:0,cuda:1: a sidecar on each GPU); default: --device for both")
    parser.add_argument("--poll-ms", type=float, default=0.5, help="get_finished interval (vLLM: every step)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the decode's step thread runs this long in Python after starting a pull and between "
                             "polls, instead of sleeping (vLLM's scheduling and forward): it holds the interpreter "
                             "lock as a busy engine does")
    parser.add_argument("--pull-from", choices=("step", "worker"), default="step",
                        help="step: the connector sends a pull on the step thread where it can (as shipped); "
                             "worker: always from its worker thread (the A/B of that choice)")
    parser.add_argument("--layout", choices=("in-place", "mirror"), default="in-place",
                        help="lend vLLM's cache itself (default) or a device mirror of it")
    parser.add_argument("--control", default="http,grpc",
                        help="how the decode learns transfer ends, comma-separated: http, grpc (a Watch stream)")
    parser.add_argument("--pull-after", choices=("lease", "save"), default="lease",
                        help="lease: the decode pulls once the prefill's lease is held (a real decode asks after the "
                             "proxy's hop); save: right after the save, racing the lease thread")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    controls = [c.strip() for c in args.control.split(",") if c.strip()]
    devices = [d.strip() for d in (args.devices or f"{args.device},{args.device}").split(",")]
    if len(devices) != 2 or len({d.split(":")[0] for d in devices}) != 1:
        parser.error(f"--devices: {args.devices!r} is not two devices of one kind (cuda:0,cuda:1)")
    on_gpu = devices[0].startswith("cuda")
    if not controls or any(c not in CONTROLS for c in controls):
        parser.error(f"--control: {args.control!r} is not a list of {', '.join(CONTROLS)}")

    import torch

    from kvferry.client import Client
    from kvferry.client.vllm_core import ConnectorConfig, Consumer, KvCache, LoadSpec, Producer, remote_params
    from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

    def sync() -> None:
        for device in set(devices) if on_gpu else ():
            torch.cuda.synchronize(device)

    per_request = args.tokens // BLOCK_SIZE
    blocks = 2 * per_request + 16
    ports = [(free_port(), free_port()) for _ in range(2)]
    serve_grpc = "grpc" in controls  # each sidecar on a gRPC port of its own beside REST
    processes = [start_sidecar(p, d, args.backend, device=device, env={"KVFERRY_TRANSFER_TIMEOUT": "60"},
                               extra=["--grpc-port", str(free_port())] if serve_grpc else None)
                 for (p, d), device in zip(ports, devices)]
    rows: dict[str, list[dict]] = {c: [] for c in controls}
    consumers: dict[str, Consumer] = {}
    try:
        urls = [f"http://127.0.0.1:{p}" for p, _ in ports]
        for url, process in zip(urls, processes):
            wait_ready(Client(url), process, timeout=180)
        generator = torch.Generator(device=devices[0]).manual_seed(0)
        shape = (LAYERS, 2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
        p_buffer = (torch.randn(shape, generator=generator, device=devices[0]) * 0.7).to(torch.bfloat16)
        d_buffer = torch.zeros(shape, dtype=torch.bfloat16, device=devices[1])
        p_layers, d_layers = list(p_buffer.unbind(0)), list(d_buffer.unbind(0))
        in_place = args.layout == "in-place"
        p_cache = KvCache(Client(urls[0]), "harness-prefill", p_layers, blocks, in_place=in_place)
        d_cache = KvCache(Client(urls[1]), "harness-decode", d_layers, blocks, in_place=in_place)
        p_config = ConnectorConfig(url=urls[0], codec=args.codec)
        producer = Producer(p_config, p_cache)
        if args.pull_from == "worker":
            Consumer._send_early = lambda self, pull: None  # every pull sent by the worker thread
        consumers = {c: Consumer(ConnectorConfig(url=urls[1], codec=args.codec, control=CONTROLS[c]), d_cache)
                     for c in controls}
        for request in range(args.requests + 1):  # the first of each path warms up
            for control in controls:  # the paths in turn, on the same sidecars and caches
                consumer = consumers[control]
                order = torch.randperm(blocks, generator=torch.Generator().manual_seed(request)).tolist()
                src, dst = order[:per_request], order[per_request:2 * per_request]
                d_buffer.zero_()
                sync()
                rid = f"req-{control}-{request}"
                lease = producer.save(rid, src)
                sync()
                saved = time.monotonic()
                if args.pull_after == "lease":  # as behind the proxy, which asks the decode once the prefill answered
                    while lease.generation is None and lease.held and time.monotonic() - saved < 10:
                        time.sleep(0.0001)
                    if lease.generation is None:
                        raise RuntimeError(f"request {rid}: the prefill's lease was not taken")
                lease_s = time.monotonic() - saved if lease.generation is not None else float("nan")
                started_wall = time.time()
                pull = consumer.start(LoadSpec(f"dec-{control}-{request}", tuple(dst), remote_params(rid, src, p_config)))
                step(args.step_ms)
                if pull.error:
                    raise RuntimeError(pull.error)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    received, failed = consumer.poll()
                    if received or failed:
                        break
                    step(args.step_ms) if args.step_ms else time.sleep(args.poll_ms / 1e3)
                if failed or not received:
                    raise RuntimeError(f"request {rid} did not load: {consumer.failed_blocks}")
                sync()
                ids_p, ids_d = torch.tensor(src, device=devices[0]), torch.tensor(dst, device=devices[1])
                exact = torch.equal(p_buffer.index_select(2, ids_p).view(torch.int16),
                                    d_buffer.index_select(2, ids_d).view(torch.int16).to(devices[0]))
                producer.finished_sending({rid})
                if request:
                    rows[control].append(row_of(consumer.stats[-1], pull, d_cache.client, exact, started_wall))
                    rows[control][-1]["lease_seconds"] = lease_s
        for consumer in consumers.values():
            consumer.close()
        p_cache.close()
        d_cache.close()
    finally:
        stop_sidecars(processes)
    device = " and ".join(sorted({torch.cuda.get_device_name(d) for d in devices})) if on_gpu else "CPU"
    if on_gpu and len(set(devices)) > 1:
        device = f"{len(set(devices))} × {device} (prefill {devices[0]}, decode {devices[1]})"
    first = rows[controls[0]]
    print(f"vLLM connector core, {device}, {time.strftime('%Y-%m-%d')}: {args.tokens} tokens of Llama-3-8B KV "
          f"({first[0]['bytes_raw'] / 2**20:.0f} MiB, {LAYERS} layers) per request, codec {args.codec}, {args.layout}, "
          f"{len(first)} requests per control path\n`{' '.join(sys.argv)}`\n")
    print("| control | decode waits median / p90 | transfer median / p90 | overhead median / p90 "
          "| answer after the transfer's end median / p90 | load into vLLM's cache | ends pushed | codec | bit-exact |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    summary = {}
    for control in controls:
        summary[control] = report(control, rows[control])
    for control in controls:
        parts(control, rows[control])
    if args.json:
        args.json.write_text(json.dumps({"device": device, "command": " ".join(sys.argv), "summary": summary,
                                         "rows": rows}, indent=1))
    ok = all(r["bit_exact"] for c in controls for r in rows[c])
    pushed = all(r["control"] == "grpc" for r in rows.get("grpc", []))
    if not pushed:
        print("some grpc-path requests' ends did not come by the Watch stream (see the 'ends pushed' column)")
    return 0 if ok and pushed else 1


def step(ms: float) -> None:
    """``ms`` of Python on this thread, never letting go of the interpreter lock of its own accord."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def row_of(stats: dict, pull, local, exact: bool, started_wall: float) -> dict:
    """One request's times, on this host's wall clock where they cross processes. The transfer's
    time is the prefill's sidecar's record (submit to DONE), whichever record told the decode."""
    sent = pull.client.transfer(pull.transfer_id)  # the prefill sidecar's record of it
    created, seconds = sent["created"], sent["seconds"]  # this host's wall clock
    announced = created + (sent["stages"] or {}).get("announced", float("nan"))
    incoming = local.transfer(pull.transfer_id)  # the decode sidecar's record of it
    received = incoming["created"] + incoming["seconds"]
    return {**stats, "transfer_seconds": seconds, "stages": sent["stages"], "bit_exact": exact,
            "send_seconds": pull.asked_wall - started_wall, "ask_seconds": created - pull.asked_wall,
            "reply_seconds": pull.answered_wall - created - seconds,
            "received_reply_seconds": pull.answered_wall - received,
            "overhead_seconds": stats["wait_seconds"] - seconds,
            "admit_seconds": incoming["created"] - announced, "receive_seconds": incoming["seconds"],
            "done_back_seconds": created + seconds - received}


def report(control: str, rows: list[dict]) -> dict:
    """The path's row of the table; its medians and p90s, in ms."""
    out = {}
    for key in ("wait_seconds", "transfer_seconds", "overhead_seconds", "reply_seconds", "load_seconds"):
        values = [r[key] for r in rows]
        out[key.removesuffix("_seconds")] = {"median_ms": statistics.median(values) * 1e3,
                                              "p90_ms": quantile(values, 0.9) * 1e3}

    def cell(key: str) -> str:
        return f"{out[key]['median_ms']:.3f} / {out[key]['p90_ms']:.3f} ms"

    pushed = sum(r["control"] == "grpc" for r in rows)
    print(f"| {control} | {cell('wait')} | {cell('transfer')} | {cell('overhead')} | {cell('reply')} | "
          f"{out['load']['median_ms']:.2f} ms | {pushed}/{len(rows)} | {rows[-1]['codec']} | "
          f"{'all' if all(r['bit_exact'] for r in rows) else 'NO'} |")
    out["pushed"] = pushed
    return out


def parts(control: str, rows: list[dict]) -> None:
    """Where a path's overhead and the transfer's end go, median ms."""
    median = {k: statistics.median(r[k] for r in rows) * 1e3
              for k in ("send_seconds", "ask_seconds", "reply_seconds", "admit_seconds", "receive_seconds",
                        "done_back_seconds")}
    stages = {k: statistics.median(r["stages"][k] for r in rows if k in (r["stages"] or {})) * 1e3
              for k in rows[0]["stages"] or {}}
    leases = [r["lease_seconds"] for r in rows if r["lease_seconds"] == r["lease_seconds"]]
    if leases:
        print(f"\n{control}: the prefill's lease held, median ms after its save returned: "
              f"{statistics.median(leases) * 1e3:.3f}",
              end="")
    print(f"\n{control}: the overhead's parts, median ms: from the pull's start to its request sent "
          f"{median['send_seconds']:.3f}, from there to the transfer's start {median['ask_seconds']:.3f}, "
          f"from the transfer's end to its answer {median['reply_seconds']:.3f}")
    print(f"{control}: transfer stages, median ms since submit: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    print(f"{control}: the answer after the receiver's done (the decode's own sidecar's record), median ms: "
          f"{statistics.median(r['received_reply_seconds'] for r in rows) * 1e3:.3f}")
    print(f"{control}: the transfer's end, median ms: from its announce to the receiver's record "
          f"{median['admit_seconds']:.2f}, to the receiver's done {median['receive_seconds']:.2f}, to the sender's "
          f"done {median['done_back_seconds']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
