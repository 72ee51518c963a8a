"""Load: many prefill sidecars into one decode sidecar (``--senders N``), or one prefill sidecar
into many (``--receivers N``), with ``--inflight M`` transfers in flight at all times.

    python bench/load.py [--senders 8 | --receivers 8] [--inflight 64] [--transfers 1000] [--seconds S]
                         [--codecs raw,auto] [--layers 32] [--tokens 4096] [--layout mirror|spread]
                         [--netns GBIT] [--check-every 1] [--json FILE]

Each transfer is one vLLM request of a Llama-3-8B-shaped cache (8 KV heads, head dim 128, bf16,
blocks of 16 tokens: 4,096 tokens are 256 blocks), submitted as the vLLM connector submits it
(``kvferry/client/vllm_core.py``): one ``send`` (submit and wait in one HTTP call) with packed
block ids, scattered source blocks into a scattered destination slot. Layouts:

- ``mirror`` (the connector on a CPU): a region block holds every layer's page of a vLLM block
  (``[layers, 2, 16, 8, 128]``), a request names 256 ids;
- ``spread`` (the connector over vLLM's own GPU memory): a region block is one page of one layer
  and K or V (``[16, 8, 128]``), a request names 256 ids each spread over ``2 * layers`` ids
  ``num_blocks`` apart.

Sources are real KV (``demo.llama_blocks``) with each block's first 8 bytes stamped with its
sender and index (a block delivered to the wrong place is caught). Regions are POSIX shared memory
this process lends (no upload); each in-flight worker owns one destination slot, zeroes it and
compares it bit for bit with its source after every ``--check-every``-th transfer.

Sidecars never take the same-host shortcut unless ``--same-host``: on loopback each daemon runs
under a hostname of its own (``unshare --uts``, root) and dials TCP (``local_socket`` off); with
``--netns`` each is a host of its own on a bridge (``kvferry.testing.netns``) whose links are
shaped to GBIT Gbit/s both ways.

Reports per codec: transfers/s, GB/s of raw KV, per-transfer p50/p99 (the client's wall time from
request to answer, 429 retries included, and the sidecar's own submit-to-done), 429 answers seen,
failures, the sidecars' CPU seconds per GB moved (``/proc/<pid>/stat``) and their RSS without the
shared-memory regions they map (``RssAnon`` + ``RssFile``) after the warm-up and at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.client import Client  # noqa: E402
from kvferry.client.sdk import RETRY_STATUSES, packed  # noqa: E402

HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 128, 16
CLOCK = os.sysconf("SC_CLK_TCK")


class CountingClient(Client):
    """The SDK's client, counting answers it was refused with for now (429/503; it retries them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused = 0

    def _send(self, *args, **kwargs):
        reply = super()._send(*args, **kwargs)
        if reply.status_code in RETRY_STATUSES:
            self.refused += 1
        return reply


@dataclass
class Daemon:
    name: str
    role: str  # sender | receiver
    url: str
    data_address: str
    pid: int
    token: str = ""
    handle: object = None  # the Popen or netns Sidecar

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK  # utime, stime

    def rss(self) -> dict[str, int]:
        """Bytes resident: all, and without the shared memory it maps (the regions)."""
        status = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                status[key] = int(value.split()[0]) * 1024
        return {"rss": status.get("VmRSS", 0), "private": status.get("RssAnon", 0) + status.get("RssFile", 0)}


# ---- the sidecars -------------------------------------------------------------------------------
def _free_port() -> int:
    from kvferry.demo import free_port

    return free_port()


def start_loopback(names: list[tuple[str, str]], same_host: bool, workdir: Path, env: dict) -> list[Daemon]:
    """``kvferry serve`` per name on 127.0.0.1, each under a hostname of its own unless ``same_host``."""
    from kvferry.demo import _PEER_SECRET

    daemons, processes = [], []
    own_host = not same_host and os.geteuid() == 0 and shutil.which("unshare")
    for name, role in names:
        port, data_port = _free_port(), _free_port()
        serve = [sys.executable, "-m", "kvferry.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--data-host", "127.0.0.1", "--data-port", str(data_port), "--advertise-host", "127.0.0.1",
                 "--transport-backend", "tcp", "--device", "cpu", "--log-level", "warning"]
        if own_host:
            serve = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', f"kvf-load-{name}", *serve]
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
        environment.update({"KVFERRY_PEER_SECRET": _PEER_SECRET, "UCX_TLS": "tcp", **env})
        if not same_host:  # a host of its own is reached over TCP, not the same-host Unix socket
            environment.setdefault("KVFERRY_LOCAL_SOCKET", "false")
        environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        with open(workdir / f"{name}.log", "w") as log:
            process = subprocess.Popen(serve, env=environment, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT)
        processes.append(process)
        daemons.append(Daemon(name, role, f"http://127.0.0.1:{port}", f"127.0.0.1:{data_port}", process.pid,
                              handle=process))
    for daemon in daemons:
        client = Client(daemon.url, timeout=30)
        deadline = time.monotonic() + 180
        while not client.ready():
            if daemon.handle.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar {daemon.name} did not start: "
                                   f"{(workdir / f'{daemon.name}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        client.close()
    if not own_host and not same_host:
        print("note: not root or no unshare: the sidecars share a hostname and may write straight into each "
              "other's memory", file=sys.stderr)
    return daemons


def start_netns(net, names: list[tuple[str, str]], env: dict) -> list[Daemon]:
    daemons = []
    for name, role in names:
        sidecar = net.sidecar(name, env=env, backend="tcp", device="cpu", ready_timeout=180)
        daemons.append(Daemon(name, role, sidecar.url, sidecar.data_address, sidecar.process.pid, net.token,
                              handle=sidecar))
    return daemons


def stop(daemons: list[Daemon]) -> None:
    for daemon in daemons:
        if isinstance(daemon.handle, subprocess.Popen):
            daemon.handle.terminate()
    for daemon in daemons:
        if isinstance(daemon.handle, subprocess.Popen):
            try:
                daemon.handle.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.handle.kill()


# ---- the load -----------------------------------------------------------------------------------
@dataclass
class Shape:
    layers: int
    tokens: int
    layout: str  # mirror | spread

    @property
    def per_request(self) -> int:  # vLLM blocks per request
        return -(-self.tokens // BLOCK_TOKENS)

    @property
    def planes(self) -> int:  # region blocks per vLLM block
        return 1 if self.layout == "mirror" else 2 * self.layers

    @property
    def block_shape(self) -> tuple[int, ...]:
        page = (BLOCK_TOKENS, HEADS, HEAD_DIM)
        return (self.layers, 2, *page) if self.layout == "mirror" else page

    @property
    def request_bytes(self) -> int:
        return self.per_request * self.layers * 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2

    def ids(self, vllm_ids: list[int], num_blocks: int) -> dict:
        """A request's blocks as the connector submits them."""
        return packed(vllm_ids) if self.planes == 1 else packed(vllm_ids, self.planes, num_blocks)

    def region_ids(self, vllm_ids: list[int], num_blocks: int) -> list[int]:
        """The region blocks those ids stand for, in order."""
        return [b + k * num_blocks for b in vllm_ids for k in range(self.planes)]


def source_cache(shape: Shape, num_blocks: int, stamp: int):
    """``num_blocks`` vLLM blocks of real KV as the region holds them, every block's first 8 bytes
    (of each plane) stamped with (``stamp``, plane, block)."""
    import torch

    from kvferry.demo import llama_blocks

    kv = llama_blocks(ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz", num_blocks, layers=shape.layers)
    if shape.layout == "spread":  # [layer, kv, block, ...] end to end: one region block per (plane, block)
        kv = kv.permute(1, 2, 0, 3, 4, 5).reshape(2 * shape.layers * num_blocks, *shape.block_shape).contiguous()
    words = kv.view(kv.shape[0], -1).view(torch.int16)
    blocks = torch.arange(kv.shape[0])
    words[:, 0] = stamp
    words[:, 1] = (blocks // num_blocks).to(torch.int16)
    words[:, 2] = (blocks % num_blocks).to(torch.int16)
    words[:, 3] = (blocks >> 15).to(torch.int16)
    return kv


@dataclass
class Worker:
    index: int
    sender: Daemon
    receiver: Daemon
    slot: range  # its destination vLLM blocks
    latencies: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    raw_bytes: int = 0
    wire_bytes: int = 0
    checked: int = 0
    mismatched: int = 0
    chosen: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)  # chosen codec -> the last reason given for it
    issued: int = 0
    crossed: bool = True


def run_phase(args, shape: Shape, workers: list[Worker], src: dict, dst: dict, src_blocks: int, dst_blocks: dict,
              codec: str, count: int, seconds: float, check_every: int, seed: int) -> dict:
    """``count`` transfers (or until ``seconds`` pass) by the workers, each with one in flight."""
    import random

    import torch

    lock = threading.Lock()
    issued = itertools.count()
    deadline = time.monotonic() + seconds if seconds else float("inf")
    clients = {}

    def work(worker: Worker) -> None:
        rng = random.Random(seed * 1000 + worker.index)
        client = clients[worker.index] = CountingClient(worker.sender.url, token=worker.sender.token,
                                                        timeout=60, retries=args.retries)
        peer = worker.receiver.data_address
        src_tensor, dst_tensor = src[worker.sender.name], dst[worker.receiver.name]
        n_dst = dst_blocks[worker.receiver.name]
        while True:
            with lock:
                n = next(issued)
            if n >= count or time.monotonic() > deadline:
                return
            src_ids = rng.sample(range(src_blocks), shape.per_request)
            dst_ids = rng.sample(list(worker.slot), shape.per_request)
            check = check_every > 0 and n % check_every == 0
            if check:
                dst_tensor[torch.tensor(shape.region_ids(dst_ids, n_dst))] = 0
            started = time.perf_counter()
            worker.issued += 1
            try:
                record = client.send("src", shape.ids(src_ids, src_blocks), peer, "dst",
                                     shape.ids(dst_ids, n_dst), codec=codec, wait=args.wait)
            except Exception as exc:  # noqa: BLE001 (counted and reported: the load goes on)
                worker.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            elapsed = time.perf_counter() - started
            if record.get("state") != "done":
                worker.failures.append(f"{record.get('state')}: {record.get('error_kind')}: {record.get('error')}"[:300])
                continue
            worker.latencies.append(elapsed)
            worker.seconds.append(record["seconds"])
            worker.stages.append(record.get("stages") or {})
            worker.raw_bytes += record["bytes_raw"]
            worker.wire_bytes += record["bytes_wire"]
            chosen = record.get("chosen_codec") or codec
            worker.chosen[chosen] = worker.chosen.get(chosen, 0) + 1
            worker.reasons[chosen] = record.get("choice_reason") or ""
            if "same host" in (record.get("choice_reason") or "") or not record.get("bytes_wire"):
                worker.crossed = False
            if check:
                worker.checked += 1
                a = dst_tensor[torch.tensor(shape.region_ids(dst_ids, n_dst))]
                b = src_tensor[torch.tensor(shape.region_ids(src_ids, src_blocks))]
                if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    worker.mismatched += 1

    for worker in workers:
        worker.latencies, worker.seconds, worker.stages, worker.failures = [], [], [], []
        worker.raw_bytes = worker.wire_bytes = worker.checked = worker.mismatched = 0
        worker.chosen, worker.reasons, worker.crossed, worker.issued = {}, {}, True, 0
    daemons = list({w.sender.name: w.sender for w in workers}.values()) + \
        list({w.receiver.name: w.receiver for w in workers}.values())
    cpu0 = {d.name: d.cpu_seconds() for d in daemons}
    rss0 = {d.name: d.rss() for d in daemons}
    rss_series: list[tuple[float, dict]] = []
    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in workers]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    last = started
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        now = time.perf_counter()
        if now - last >= args.sample_seconds:
            last = now
            rss_series.append((round(now - started, 1), {d.name: d.rss()["private"] for d in daemons}))
            done = sum(len(w.latencies) for w in workers)
            failed = sum(len(w.failures) for w in workers)
            if args.progress:
                print(f"  {codec}: {now - started:6.1f} s  {done} done  {failed} failed  "
                      f"receiver rss {max(v for k, v in rss_series[-1][1].items()) / 2**20:.0f} MiB", flush=True)
    wall = time.perf_counter() - started
    cpu1 = {d.name: d.cpu_seconds() for d in daemons}
    rss1 = {d.name: d.rss() for d in daemons}
    for client in clients.values():
        client.close()
    latencies = sorted(x for w in workers for x in w.latencies)
    sidecar_s = sorted(x for w in workers for x in w.seconds)
    raw = sum(w.raw_bytes for w in workers)
    gb = raw / 1e9
    chosen: dict[str, int] = {}
    for w in workers:
        for k, v in w.chosen.items():
            chosen[k] = chosen.get(k, 0) + v
    failures = [f for w in workers for f in w.failures]

    def cpu(role: str) -> float:
        return sum(cpu1[d.name] - cpu0[d.name] for d in daemons if d.role == role)

    # where the slowest transfers spent their time: each stage's median, over all and over the slowest 1%
    timed = sorted(((x, st) for w in workers for x, st in zip(w.seconds, w.stages)), key=lambda p: p[0])
    slow = timed[-max(1, len(timed) // 100):]

    def stage_medians(rows: list) -> dict:
        names = {k for _, st in rows for k in st}
        return {k: round(statistics.median(st[k] for _, st in rows if k in st) * 1e3, 1) for k in sorted(names)}

    per_sender = {}
    for w in workers:
        per_sender.setdefault(f"{w.sender.name}->{w.receiver.name}", []).extend(w.seconds)
    return {
        "codec": codec, "chosen": chosen, "issued": sum(w.issued for w in workers),
        "choice_reasons": {k: v for w in workers for k, v in w.reasons.items()},
        "done": len(latencies), "failed": len(failures), "failures": failures[:20],
        "refused_429": sum(c.refused for c in clients.values()),
        "checked": sum(w.checked for w in workers), "mismatched": sum(w.mismatched for w in workers),
        "crossed_wire": all(w.crossed for w in workers),
        "wall_s": wall, "transfers_per_s": len(latencies) / wall, "gb_per_s": gb / wall,
        "bytes_raw": raw, "bytes_wire": sum(w.wire_bytes for w in workers),
        "p50_ms": _pct(latencies, 50) * 1e3, "p99_ms": _pct(latencies, 99) * 1e3, "max_ms": _pct(latencies, 100) * 1e3,
        "sidecar_p50_ms": _pct(sidecar_s, 50) * 1e3, "sidecar_p99_ms": _pct(sidecar_s, 99) * 1e3,
        "stages_ms": stage_medians(timed) if timed else {}, "slowest_1pct_stages_ms": stage_medians(slow) if slow else {},
        "per_pair_p50_ms": {k: round(_pct(sorted(v), 50) * 1e3, 1) for k, v in per_sender.items()},
        "sender_cpu_s_per_gb": cpu("sender") / gb if gb else None,
        "receiver_cpu_s_per_gb": cpu("receiver") / gb if gb else None,
        "rss_start": {k: v["private"] for k, v in rss0.items()}, "rss_end": {k: v["private"] for k, v in rss1.items()},
        "rss_series": rss_series,
        "rss_trend_mib_per_1k": _rss_trend(rss_series, len(latencies) / wall),
    }


def _rss_trend(series: list[tuple[float, dict]], per_second: float) -> dict[str, float]:
    """Each sidecar's RSS growth in MiB per 1,000 transfers over the run's second half: the
    least-squares slope of its samples there. A heap fills to its working size over the first
    minutes (16 MiB frames in several threads' arenas); a leak goes on growing after that, an
    allocator's swings around a level do not."""
    if not series or per_second <= 0:
        return {}
    points = [(t, sample) for t, sample in series if t >= series[-1][0] / 2]
    if len(points) < 3:
        return {}
    times = [t for t, _ in points]
    mean_t = statistics.fmean(times)
    spread = sum((t - mean_t) ** 2 for t in times)
    trend = {}
    for name in points[0][1]:
        values = [sample[name] for _, sample in points]
        mean_v = statistics.fmean(values)
        slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread  # bytes per second
        trend[name] = round(slope / per_second * 1000 / 2**20, 2)
    return trend


def _pct(values: list[float], p: float) -> float:
    """Nearest rank."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, -(-len(values) * p // 100) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", type=int, default=1)
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--transfers", type=int, default=1000, help="timed transfers per codec")
    parser.add_argument("--seconds", type=float, default=0, help="stop each codec's timed run after this (0: never)")
    parser.add_argument("--warmup", type=int, default=0, help="untimed transfers first (default: 2 per worker)")
    parser.add_argument("--codecs", default="raw,auto")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layout", choices=("mirror", "spread"), default="mirror")
    parser.add_argument("--source-requests", type=int, default=2, help="each sender's region holds this many requests")
    parser.add_argument("--netns", type=float, default=0, help="Gbit/s: hosts in network namespaces (root)")
    parser.add_argument("--same-host", action="store_true", help="loopback: let the same-host shortcut apply")
    parser.add_argument("--check-every", type=int, default=1, help="compare every k-th transfer (0: none)")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds one send waits for its end")
    parser.add_argument("--retries", type=int, default=6, help="the SDK's retries of a 429/503")
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every sidecar")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.senders, args.receivers) != 1 or args.inflight < 1:
        parser.error("one side has one sidecar: --senders N or --receivers N; --inflight >= 1")
    import torch

    shape = Shape(args.layers, args.tokens, args.layout)
    names = [(f"s{i}", "sender") for i in range(args.senders)] + [(f"r{i}", "receiver") for i in range(args.receivers)]
    env = {"KVFERRY_TRANSFER_TIMEOUT": "60", **dict(e.split("=", 1) for e in args.env)}
    workdir = Path(tempfile.mkdtemp(prefix="kvferry-load-"))
    net, daemons, segments = None, [], []
    try:
        if args.netns:
            from kvferry.testing import netns

            net = netns.Network([n for n, _ in names])
            net.shape_all(args.netns * 1000)
            daemons = start_netns(net, names, env)
        else:
            daemons = start_loopback(names, args.same_host, workdir, env)
        senders = [d for d in daemons if d.role == "sender"]
        receivers = [d for d in daemons if d.role == "receiver"]
        # workers round-robin over the many side; each owns a destination slot of its receiver
        workers, slots = [], {r.name: 0 for r in receivers}
        for i in range(args.inflight):
            s, r = senders[i % len(senders)], receivers[i % len(receivers)]
            k = slots[r.name]
            slots[r.name] += 1
            workers.append(Worker(i, s, r, range(k * shape.per_request, (k + 1) * shape.per_request)))
        src_blocks = args.source_requests * shape.per_request
        src, dst, dst_blocks = {}, {}, {}
        for i, s in enumerate(senders):
            with Client(s.url, token=s.token, timeout=120) as c:
                kv = source_cache(shape, src_blocks, stamp=i + 1)
                _, handle = c.region_from_tensor("src", kv, kind="shm")
                segments.append(handle)
                src[s.name] = torch.frombuffer(handle.buf, dtype=torch.bfloat16).view(kv.shape)
        for r in receivers:
            n = max(1, slots[r.name]) * shape.per_request
            dst_blocks[r.name] = n
            with Client(r.url, token=r.token, timeout=120) as c:
                rows = n * shape.planes
                _, handle = c.region_from_tensor("dst", torch.zeros((rows, *shape.block_shape), dtype=torch.bfloat16),
                                                 kind="shm")
                segments.append(handle)
                dst[r.name] = torch.frombuffer(handle.buf, dtype=torch.bfloat16).view(rows, *shape.block_shape)
        phases = []
        for c, codec in enumerate(args.codecs.split(",")):
            warm = args.warmup or 2 * args.inflight
            run_phase(args, shape, workers, src, dst, src_blocks, dst_blocks, codec, warm, 0, 1, seed=1000 + c)
            row = run_phase(args, shape, workers, src, dst, src_blocks, dst_blocks, codec, args.transfers,
                            args.seconds, args.check_every, seed=c)
            phases.append(row)
            print(_line(args, shape, row), flush=True)
        report = {
            "command": " ".join(sys.argv), "host": platform.node(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "mode": f"netns {args.netns:g} Gbit/s" if args.netns else ("loopback, same host" if args.same_host
                                                                      else "loopback"),
            "senders": args.senders, "receivers": args.receivers, "inflight": args.inflight,
            "layers": args.layers, "tokens": args.tokens, "layout": args.layout,
            "blocks_per_request": shape.per_request, "request_bytes": shape.request_bytes, "phases": phases,
        }
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        bad = [p for p in phases if p["failed"] or p["mismatched"] or not p["done"]]
        return 1 if bad else 0
    finally:
        if net is not None:
            net.close()
        else:
            stop(daemons)
        for handle in segments:
            with contextlib.suppress(Exception):
                handle.close()
                handle.unlink()
        shutil.rmtree(workdir, ignore_errors=True)


def _line(args, shape: Shape, row: dict) -> str:
    mb = shape.request_bytes / 2**20
    rss = "; ".join(f"{k} {row['rss_start'][k] / 2**20:.0f}->{row['rss_end'][k] / 2**20:.0f}" for k in row["rss_end"])
    trend = ", ".join(f"{k} {v:+.1f}" for k, v in row.get("rss_trend_mib_per_1k", {}).items()) or "too few samples"
    return (f"{args.senders}->{args.receivers} inflight {args.inflight} {row['codec']} {mb:.0f} MiB/request: "
            f"{row['done']} done {row['failed']} failed {row['refused_429']} x429 "
            f"{row['checked']} checked {row['mismatched']} wrong | {row['transfers_per_s']:.1f}/s "
            f"{row['gb_per_s']:.3f} GB/s p50 {row['p50_ms']:.0f} p99 {row['p99_ms']:.0f} ms "
            f"(sidecar {row['sidecar_p50_ms']:.0f}/{row['sidecar_p99_ms']:.0f}) | cpu s/GB send "
            f"{row['sender_cpu_s_per_gb'] or 0:.2f} recv {row['receiver_cpu_s_per_gb'] or 0:.2f} | "
            f"rss MiB {rss} (second half, per 1k transfers: {trend}) | chose {row['chosen']}")


if __name__ == "__main__":
    sys.exit(main())
