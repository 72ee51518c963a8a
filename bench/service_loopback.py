"""Two sidecar processes on loopback move GiB-scale real KV, raw vs SplitZip.

    python bench/service_loopback.py [--gib 1] [--backend tcp|ucxx] [--device cpu|cuda] [--chunk-mib 8]

The region is the real SmolLM2 KV sample tiled to the requested size (blocks of [3, 511, 64]
bf16, 196 KiB each). Prints one row per codec: raw and wire bytes, seconds from submit to the
receiver's last block, GB/s of raw KV. The sender's ``seconds`` is what is reported.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.client import Client  # noqa: E402
from kvferry.demo import free_port, load_kv, start_sidecar, stop_sidecars, wait_ready  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--codecs", default="raw,splitzip")
    args = parser.parse_args()
    kv = load_kv(ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz")
    blocks = int(args.gib * (1 << 30) // (kv[0].numel() * 2))
    env = {"KVFERRY_CHUNK_BYTES": str(args.chunk_mib << 20), "KVFERRY_TRANSFER_TIMEOUT": "120"}
    ports = [(free_port(), free_port()) for _ in range(2)]
    processes = [start_sidecar(p, d, args.backend, env=env, device=args.device) for p, d in ports]
    try:
        a, b = (Client(f"http://127.0.0.1:{p}", timeout=600) for p, _ in ports)
        for client, process in zip((a, b), processes):
            wait_ready(client, process, timeout=120)
        source = kv.repeat((blocks + 59) // 60, 1, 1, 1)[:blocks]
        started = time.perf_counter()
        a.region_from_tensor("kv", source)
        print(f"uploaded {blocks} blocks ({source.numel() * 2 / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s;"
              f" backend {args.backend}, device {args.device}, chunk {args.chunk_mib} MiB", flush=True)
        print(f"{'codec':<10}{'raw GiB':>9}{'wire GiB':>10}{'ratio':>8}{'seconds':>9}{'GB/s':>8}  state")
        for name in args.codecs.split(","):
            b.create_region(f"kv-{name}", blocks, list(kv.shape[1:]), "bfloat16")
            ids = list(range(blocks))
            transfer = a.submit("kv", range(blocks), b.data_address(), f"kv-{name}", range(blocks), codec=name)
            r = a.wait(transfer, timeout=600)
            seconds = r["seconds"] or float("nan")
            print(f"{name:<10}{r['bytes_raw'] / 2**30:>9.3f}{r['bytes_wire'] / 2**30:>10.3f}{(r['ratio'] or 0):>8.3f}"
                  f"{seconds:>9.2f}{r['bytes_raw'] / seconds / 1e9:>8.3f}  {r['state']} {r.get('choice_reason') or ''}",
                  flush=True)
            b.delete_region(f"kv-{name}")
    finally:
        stop_sidecars(processes)


if __name__ == "__main__":
    main()
