"""End to end: two sidecars move a Llama-3-8B-shaped paged KV cache, raw vs SplitZip vs auto,
over emulated links, next to the SplitZip Appendix-B model.

    python bench/e2e.py [--tokens 1K,2K,4K,8K,16K,32K,64K] [--links 12.5,25,50,100,200,max]
                        [--codecs raw,splitzip,auto] [--repeats 3] [--progress]
    python bench/e2e.py --plot-only bench/out/e2e.json

Layout: one block = 16 tokens of every layer's K and V, ``[32 layers, 2, 16, 8 heads, 128]``
bf16 (2 MiB), filled with the real KV sample by position (``demo.llama_blocks``: each position one
layer, K/V, head and channel of the sample, as in a serving engine's cache). The prefill side's cache
lives in this process and is shared with the senders by CUDA IPC (shared memory on a CPU
machine), as a serving engine shares it; the decode side's cache is an ``owned`` region of the
receiving sidecar. One receiver on the second GPU (the first when only one is visible) and one
sender per link speed on the first GPU, each pacing its outgoing data to that speed
(``KVFERRY_EMULATED_LINK_GBPS``; ``max`` = unpaced, the stack's own ceiling). Between GPUs the
links run over ucxx (UCX's CUDA IPC, the one transport here faster than the links it stands for),
on a CPU machine over tcp; ``--backend`` names another.

Per point: seconds (the sender's, submit to the receiver's last block written), effective GB/s
of raw KV, speedup over raw, wire ratio, and the model max(S/Ce, S/(r*B), S/Cd) with Ce/Cd the
codec's throughput at the pipeline's chunk size measured in this run. Sampled destination blocks
are zeroed before and byte-compared after every transfer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvferry import codec  # noqa: E402
from kvferry.client import Client  # noqa: E402
from kvferry.demo import (LLAMA_AXES, free_port, llama_blocks, settle, start_sidecar, stop_sidecars, until_steady,  # noqa: E402
                          wait_ready)
from kvferry.engine.engine import CPU_CHUNK_BYTES, GPU_CHUNK_BYTES  # noqa: E402

KV_SAMPLE = ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz"
KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 128, 16
GB = 1e9


@dataclass
class Point:
    link: str  # GB/s or "max"
    tokens: int
    codec: str
    bytes_raw: int
    seconds: list[float]
    bytes_wire: int
    chosen: str
    exact: bool
    error: str | None = None
    reason: str = ""  # why auto chose what it chose (the last transfer's)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def parse_tokens(text: str) -> list[int]:
    return [int(float(t[:-1]) * 1024) if t.upper().endswith("K") else int(t) for t in text.split(",")]


def pick_devices(wanted: str) -> tuple[str, str]:
    if wanted != "auto":
        sender, _, receiver = wanted.partition(",")
        return sender, receiver or sender
    count = torch.cuda.device_count()
    if count >= 2:
        return "cuda:0", "cuda:1"
    return ("cuda:0", "cuda:0") if count == 1 else ("cpu", "cpu")


def fill_cache(blocks: int, layers: int, device: str) -> torch.Tensor:
    """The prefill cache: the real KV sample laid out by position into ``blocks`` Llama-shaped
    blocks (``demo.llama_blocks``)."""
    return llama_blocks(KV_SAMPLE, blocks, layers=layers, device=device, heads=KV_HEADS, head_dim=HEAD_DIM,
                        block_tokens=BLOCK_TOKENS)


def time_codec(cache: torch.Tensor, blocks_per_chunk: int, decode_device: str, calls: int = 10) -> dict:
    """Encode/decode GB/s of one pipeline chunk per call, per-call costs included (as the sidecar
    pays them): median over ``calls`` calls, each synchronized."""
    book = codec.calibrate(cache[:blocks_per_chunk])
    ids = torch.arange(blocks_per_chunk, device=cache.device)
    target = torch.empty_like(cache[:blocks_per_chunk], device=decode_device)
    target_ids = torch.arange(blocks_per_chunk, device=decode_device)
    encode_s, decode_s = [], []
    for i in range(calls + 2):  # two warm-ups
        chunk_ids = ids + (i * blocks_per_chunk) % max(1, cache.shape[0] - blocks_per_chunk)
        _sync(cache.device)
        start = time.perf_counter()
        frame = codec.encode_blocks(cache, chunk_ids, book)
        _sync(cache.device)
        encoded = time.perf_counter()
        frame = frame.to(decode_device)
        _sync(target.device)
        start_decode = time.perf_counter()
        codec.decode_blocks(frame, target, target_ids)
        _sync(target.device)
        if i >= 2:
            encode_s.append(encoded - start)
            decode_s.append(time.perf_counter() - start_decode)
    raw = blocks_per_chunk * cache[0].numel() * cache.element_size()
    return {"chunk_bytes": raw, "encode_gbps": raw / statistics.median(encode_s) / GB,
            "decode_gbps": raw / statistics.median(decode_s) / GB,
            "ratio": raw / frame.numel(), "codebook": book.to_json()}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Rig:
    """The receiver and one sender per link speed, as separate ``kvferry serve`` processes."""

    def __init__(self, args, sender_device: str, receiver_device: str, logs: Path):
        self.links = args.links
        self.ucx_tls = args.ucx_tls or ("tcp,cuda_copy,cuda_ipc" if sender_device.startswith("cuda") else "tcp")
        env = {"KVFERRY_TRANSFER_TIMEOUT": str(args.transfer_timeout), "UCX_TLS": self.ucx_tls}
        if args.chunk_mib:
            env["KVFERRY_CHUNK_BYTES"] = str(args.chunk_mib << 20)
        self.processes, self.clients = [], {}
        for name, device, link in [("receiver", receiver_device, "max"),
                                   *((f"sender-{link}", sender_device, link) for link in self.links)]:
            port = free_port()
            extra_env = dict(env, KVFERRY_EMULATED_LINK_GBPS="0" if link == "max" else link)
            process = start_sidecar(port, free_port(), args.backend, env=extra_env, device=device,
                                    log=logs / f"{name}.log")
            self.processes.append(process)
            self.clients[name] = (Client(f"http://127.0.0.1:{port}", timeout=600), process, port)
        for client, process, _ in self.clients.values():
            wait_ready(client, process, timeout=300)

    def client(self, name: str) -> Client:
        return self.clients[name][0]

    @property
    def receiver_url(self) -> str:
        """The receiver's data address (where a sender's chunks go)."""
        return self.client("receiver").data_address()

    def close(self) -> None:
        stop_sidecars(self.processes)


def block_bytes(cache: torch.Tensor, index: int) -> bytes:
    return cache[index].reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def run_point(rig: Rig, link: str, tokens: int, codec_name: str, expected: dict[int, bytes]) -> tuple:
    """One transfer of the first ``tokens`` worth of blocks; the ``expected`` destination blocks
    are zeroed first and compared after, so a transfer that writes nothing cannot pass."""
    receiver = rig.client("receiver")
    for b, data in expected.items():
        receiver.put_block("dst", b, bytes(len(data)))
    sender = rig.client(f"sender-{link}")
    ids = list(range(tokens // BLOCK_TOKENS))
    transfer = sender.submit("src", ids, rig.receiver_url, "dst", ids, codec=codec_name, codebook="kv")
    result = sender.wait(transfer, timeout=120)
    exact = result["state"] == "done" and all(receiver.get_block("dst", b) == data for b, data in expected.items())
    return result, exact


def link_backend(requested: str, device: str) -> str:
    """The transport under the emulated links: the one asked for, else (``auto``) ucxx between
    GPUs where it imports, tcp otherwise. Links of 50 GB/s and more need UCX's CUDA IPC between
    the GPUs of this host; the sidecars' own ``auto`` takes TCP lanes where no RDMA device is
    open to them, which carry ~10 GB/s between two H200s."""
    if requested != "auto":
        return requested
    if device.startswith("cuda") and importlib.util.find_spec("ucxx") is not None:
        return "ucxx"
    return "tcp"


def sweep(args) -> dict:
    sender_device, receiver_device = pick_devices(args.devices)
    args.backend = link_backend(args.backend, sender_device)
    max_blocks = max(args.tokens) // BLOCK_TOKENS
    cache = fill_cache(max_blocks, args.layers, sender_device)
    block_shape = list(cache.shape[1:])
    chunk_bytes = args.chunk_mib << 20 or (GPU_CHUNK_BYTES if cache.is_cuda else CPU_CHUNK_BYTES)
    per_chunk = max(1, chunk_bytes // block_bytes_len(cache))  # blocks per chunk, as the sidecar plans them
    codec_speed = time_codec(cache, min(per_chunk, max_blocks), receiver_device)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvferry-e2e-"))
    logs.mkdir(parents=True, exist_ok=True)
    fixed: dict[str, float] = {}

    def report(done: list[Point]) -> dict:
        return {"meta": meta(args, rig.ucx_tls, sender_device, receiver_device, block_shape, logs), "codec": codec_speed,
                "fixed_s": fixed, "points": [dict(asdict(p), median_s=p.median_s) for p in done]}

    rig = Rig(args, sender_device, receiver_device, logs)
    shm = []
    started = time.monotonic()
    points: list[Point] = []
    try:
        rig.client("receiver").create_region("dst", max_blocks, block_shape, "bfloat16")
        kind = "cuda_ipc" if cache.is_cuda else "shm"
        for link in args.links:
            client = rig.client(f"sender-{link}")
            _, handle = client.region_from_tensor("src", cache, kind=kind, axes=LLAMA_AXES)
            if handle is not None:
                shm.append(handle)
            client.put_codebook("kv", codec_speed["codebook"])
        fixed.update(fixed_cost(rig, args.links[-1], args.codecs))
        generator = torch.Generator().manual_seed(0)
        plan = [(link, tokens) for link in args.links for tokens in args.tokens]
        progress = _progress(len(plan) * args.repeats * len(args.codecs), args.progress)
        failures: dict[str, int] = {}
        for link, tokens in plan:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping before link {link}, {tokens} tokens", flush=True)
                break
            if failures.get(link, 0) >= 2:
                print(f"link {link}: skipping {tokens} tokens after repeated failures", file=sys.stderr, flush=True)
                continue
            blocks = tokens // BLOCK_TOKENS
            samples = [0, blocks - 1, *torch.randint(0, blocks, (2,), generator=generator).tolist()]
            results = measure(rig, cache, link, tokens, args.codecs, args.repeats, samples, progress)
            failures[link] = failures.get(link, 0) + sum(bool(p.error) or not p.exact for p in results)
            points.extend(results)
            print(f"link {link:>5} tokens {tokens:>6}: " + ", ".join(
                f"{p.codec} {p.median_s * 1e3:.2f} ms" for p in results), file=sys.stderr, flush=True)
            if args.out:  # after every point, so a cut-short run still leaves its results
                args.out.write_text(json.dumps(report(points), indent=1))
        progress.close()
    finally:
        rig.close()
        for handle in shm:
            handle.close()
            handle.unlink()
    return report(points)


def measure(rig: Rig, cache: torch.Tensor, link: str, tokens: int, codecs: list[str], repeats: int,
            samples: list[int], progress) -> list[Point]:
    """One sweep point: ``repeats`` transfers per codec, interleaved so drift hits each alike."""
    blocks = tokens // BLOCK_TOKENS
    points = {name: Point(link, tokens, name, blocks * block_bytes_len(cache), [], 0, "", True) for name in codecs}
    expected = {b: block_bytes(cache, b) for b in samples}
    for name in codecs:  # a warm-up each, then what the sender learned from it settles
        run_point(rig, link, tokens, name, expected)
    settle(rig.client(f"sender-{link}"), "src")
    if "auto" in codecs:  # and auto has tried what it tries once per peer and size
        until_steady(lambda: run_point(rig, link, tokens, "auto", expected)[0])
    for _ in range(repeats):
        for name, point in points.items():
            result, exact = run_point(rig, link, tokens, name, expected)
            point.exact &= exact
            point.bytes_wire = result["bytes_wire"]
            point.chosen = result.get("chosen_codec") or name
            point.reason = result.get("choice_reason") or ""
            if result["state"] == "done" and result["seconds"]:
                point.seconds.append(result["seconds"])
            else:
                point.error = result.get("error") or result["state"]
            if point.error or not exact:
                print(f"link {link} tokens {tokens} {name}: {result['state']}, exact {exact}, "
                      f"error {point.error}", file=sys.stderr, flush=True)
            progress.update(1)
    return list(points.values())


def fixed_cost(rig: Rig, link: str, codecs: list[str], count: int = 10) -> dict[str, float]:
    """Median seconds of a one-block transfer per codec: the per-transfer cost the model leaves
    out (announce, thread hops, completion report)."""
    sender = rig.client(f"sender-{link}")
    costs = {}
    for name in codecs:
        results = [sender.wait(sender.submit("src", [0], rig.receiver_url, "dst", [0], codec=name, codebook="kv"),
                               timeout=60) for _ in range(count)]
        seconds = [r["seconds"] for r in results if r["state"] == "done"]
        costs[name] = statistics.median(seconds) if seconds else float("nan")
        for r in results:
            if r["state"] != "done":
                print(f"one-block {name} transfer: {r['state']}: {r.get('error')}", file=sys.stderr, flush=True)
    return costs


def block_bytes_len(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


def meta(args, ucx_tls: str, sender_device: str, receiver_device: str, block_shape: list[int], logs: Path) -> dict:
    def name(device: str) -> str:
        return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor() or "cpu"

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "sender_device": f"{sender_device} ({name(sender_device)})",
            "receiver_device": f"{receiver_device} ({name(receiver_device)})",
            "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__, "backend": args.backend,
            "ucx_tls": ucx_tls if args.backend != "tcp" else "", "block_shape": block_shape, "repeats": args.repeats, "logs": str(logs)}


def _progress(total: int, wanted: bool):
    if wanted:
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="transfer", file=sys.stderr)
        except ImportError:
            print("--progress needs tqdm; continuing without it", file=sys.stderr)

    class Silent:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    return Silent()


def analyse(report: dict) -> list[dict]:
    """One row per point with the speedup over raw, the model's prediction and the targets."""
    ce, cd = report["codec"]["encode_gbps"], report["codec"]["decode_gbps"]
    by_key = {(p["link"], p["tokens"], p["codec"]): p for p in report["points"]}
    ceiling_gbps = stack_ceiling_gbps(report)
    rows = []
    for p in report["points"]:
        raw = by_key.get((p["link"], p["tokens"], "raw"))
        s = p["bytes_raw"]
        seconds = p["median_s"]
        ratio = s / p["bytes_wire"] if p["bytes_wire"] else float("nan")
        link = None if p["link"] == "max" else float(p["link"])
        capped = (min(link, ceiling_gbps) if ceiling_gbps else None) if link else ceiling_gbps
        model, model_at_ceiling = (_model(s, p["chosen"], b, ratio, ce, cd) for b in (link, capped))
        rows.append({**p, "gbps": None if math.isnan(seconds) else s / seconds / GB, "ratio": ratio,
                     "speedup": raw["median_s"] / seconds if raw and not math.isnan(seconds) else None,
                     "model_s": model, "model_ceiling_s": model_at_ceiling})
    for row in rows:
        pair = {r["codec"]: r for r in rows if (r["link"], r["tokens"]) == (row["link"], row["tokens"])}
        best = min((pair[c]["median_s"] for c in ("raw", "splitzip") if c in pair), default=None)
        row["target"] = None
        if row["codec"] == "splitzip" and row["link"] != "max" and float(row["link"]) <= 100 and row["bytes_raw"] >= 1 << 30:
            row["target"] = row["speedup"] is not None and row["speedup"] >= 0.95 * row["ratio"]
        if row["codec"] == "auto" and best:
            row["target"] = row["median_s"] <= 1.02 * best
    return rows


def stack_ceiling_gbps(report: dict) -> float | None:
    """The stack's own ceiling: raw KV moved per second with no pacing, at the largest payload."""
    unpaced = [p for p in report["points"] if p["link"] == "max" and p["codec"] == "raw" and p["seconds"]]
    ceiling = max(unpaced, key=lambda p: p["bytes_raw"], default=None)
    return ceiling["bytes_raw"] / ceiling["median_s"] / GB if ceiling else None


def _model(s: int, chosen: str, link_gbps: float | None, ratio: float, ce: float, cd: float) -> float | None:
    """SplitZip Appendix B: a pipeline runs at its slowest stage (raw has only the link)."""
    if not link_gbps:
        return None
    if chosen == "raw":
        return s / (link_gbps * GB)
    return max(s / (ce * GB), s / (ratio * link_gbps * GB), s / (cd * GB))


def markdown(report: dict, rows: list[dict]) -> str:
    m, c = report["meta"], report["codec"]
    lines = [(f"{m['date']}; sender {m['sender_device']}, receiver {m['receiver_device']}; backend {m['backend']}"
              f" (UCX_TLS {m['ucx_tls']}); blocks {m['block_shape']} bf16; median of {m['repeats']}."),
             (f"Codec at the pipeline's chunk ({c['chunk_bytes'] >> 20} MiB per call): encode {c['encode_gbps']:.0f} GB/s,"
              f" decode {c['decode_gbps']:.0f} GB/s, ratio {c['ratio']:.3f}. Command: `{m['command']}`"),
             "Fixed cost of a one-block transfer (median s): "
             + ", ".join(f"{k} {v:.4f}" for k, v in report.get("fixed_s", {}).items())
             + f". Unpaced raw ceiling of the stack: {_num(stack_ceiling_gbps(report), 2)} GB/s.", "",
             ("| link GB/s | tokens | GiB | codec | chose | seconds | GB/s | speedup | ratio | model s "
              "| model s at min(link, ceiling) | target | exact |"),
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        target = {None: "", True: "met", False: "**missed**"}[r["target"]]
        lines.append(f"| {r['link']} | {r['tokens']} | {r['bytes_raw'] / 2**30:.2f} | {r['codec']} | {r['chosen']} "
                     f"| {_num(r['median_s'], 4)} | {_num(r['gbps'], 1)} | {_num(r['speedup'], 3)} | {_num(r['ratio'], 3)} "
                     f"| {_num(r['model_s'], 4)} | {_num(r['model_ceiling_s'], 4)} | {target} | {'yes' if r['exact'] else 'NO ' + str(r['error'])} |")
    return "\n".join(lines)


def _num(value, digits: int) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def plot(report: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(3.2 * len(links), 3.4), sharey=False, squeeze=False)
    for ax, link in zip(axes[0], links):
        for name, style in (("raw", "o-"), ("splitzip", "s-"), ("auto", "x--")):
            series = sorted((r["tokens"], r["median_s"]) for r in rows
                            if r["link"] == link and r["codec"] == name and not math.isnan(r["median_s"]))
            if series:
                ax.plot([t for t, _ in series], [s * 1e3 for _, s in series], style, label=name, markersize=4)
        for key, style, label in (("model_s", ":", "splitzip model"),
                                  ("model_ceiling_s", "-.", "model, link capped at stack ceiling")):
            model = sorted((r["tokens"], r[key]) for r in rows if r["link"] == link and r["codec"] == "splitzip" and r[key])
            if model:
                ax.plot([t for t, _ in model], [s * 1e3 for _, s in model], style, color="gray", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"link {link} GB/s" if link != "max" else "unpaced")
        ax.set_xlabel("prompt tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("transfer time (ms)")
    axes[0][0].legend(fontsize=7)
    meta_ = report["meta"]
    fig.suptitle(f"kvferry end to end, Llama-3-8B KV, {meta_['sender_device']} -> {meta_['receiver_device']}, "
                 f"{meta_['backend']} transport (unpaced ceiling {_num(stack_ceiling_gbps(report), 2)} GB/s)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=parse_tokens, default=parse_tokens("1K,2K,4K,8K,16K,32K,64K"))
    parser.add_argument("--links", type=lambda s: s.split(","), default=["12.5", "25", "50", "100", "200", "max"])
    parser.add_argument("--codecs", type=lambda s: s.split(","), default=["raw", "splitzip", "auto"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick run on a CPU")
    parser.add_argument("--devices", default="auto", help="sender[,receiver], e.g. cuda:0,cuda:1")
    parser.add_argument("--backend", default="auto",
                        help="transport: ucxx, tcp, or auto (ucxx between GPUs where it imports, else tcp)")
    parser.add_argument("--ucx-tls", default="", help="UCX_TLS for the sidecars (default: tcp + CUDA on a GPU)")
    parser.add_argument("--chunk-mib", type=int, default=0, help="pipeline chunk; 0 = the daemon's default")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="stop sweeping after this long")
    parser.add_argument("--transfer-timeout", type=float, default=30.0, help="the sidecars' no-progress limit")
    parser.add_argument("--logs", type=Path, help="directory for the sidecars' logs (default: a temporary one)")
    parser.add_argument("--progress", action="store_true", help="a progress bar (tqdm)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "e2e.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "e2e.png")
    parser.add_argument("--plot-only", type=Path, help="redraw table and plot from a saved JSON")
    args = parser.parse_args()
    # A run cut short by ``timeout`` still stops its sidecars (the finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"terminated; partial results in {args.out}"))
    if args.plot_only:
        report = json.loads(args.plot_only.read_text())
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = sweep(args)
        args.out.write_text(json.dumps(report, indent=1))
    rows = analyse(report)
    print(markdown(report, rows), flush=True)
    if not any(r["seconds"] for r in rows):
        print("no transfer finished: no plot", file=sys.stderr)
    else:
        try:
            plot(report, rows, args.plot)
            print(f"plot: {args.plot}")
        except ImportError:
            print("matplotlib not installed: no plot", file=sys.stderr)
    missed = [r for r in rows if r["target"] is False]
    print(f"targets: {sum(r['target'] is True for r in rows)} met, {len(missed)} missed; "
          f"all transfers exact: {all(r['exact'] for r in rows)}")
    sys.exit(0 if all(r["exact"] for r in rows) else 1)


if __name__ == "__main__":
    main()
