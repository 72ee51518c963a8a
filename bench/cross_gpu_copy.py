"""How to move KV blocks from one GPU's cache into another GPU's of the same host (a same-host
write under a lease between two GPUs), measured: the gather-scatter kernel on the source's GPU
writing over NVLink ("push"), the kernel on the destination's GPU reading over it ("pull"), and
the copy engines, one ``cudaMemcpyAsync`` per block on the source's stream ("copy engine"); each
also within one GPU for reference. The destination is memory another process lends by CUDA IPC
(as a receiver does), opened in the source GPU's context with lazy peer access for "push" and the
copy engine, and in its own GPU's context for "pull".

    python bench/cross_gpu_copy.py [--sizes 2M,256M,1G,4G] [--block-kib 2048] [--repeats 20] [--json FILE]

Blocks go to random destinations; every timed copy is checked bit for bit afterwards (sampled).
Per size and method: median and p90 ms, wall clock from the launch to both GPUs idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_LENDER = r"""
import sys, torch, cupy
from kvferry.engine import ipc
nbytes, device = int(sys.argv[1]), int(sys.argv[2])
t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
handle, offset, uuid = ipc.export(t)
print(handle.hex(), offset, uuid.hex(), flush=True)
sys.stdin.read()
"""


def _size(text: str) -> int:
    return int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1].upper()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2M,256M,1G,4G")
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch

    from kvferry.codec import blockcopy
    from kvferry.engine import peer
    from kvferry.engine.ipc import Mapper

    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    block = args.block_kib << 10
    sizes = [_size(s) for s in args.sizes.split(",")]
    blocks_total = 2 * max(sizes) // block
    src = torch.randint(-32768, 32767, (blocks_total, block // 2), dtype=torch.int16, device="cuda:0")
    lenders, rows = [], []
    try:
        mapped = {}
        for device in (0, 1):
            lender = subprocess.Popen([sys.executable, "-c", _LENDER, str(blocks_total * block), str(device)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
            lenders.append(lender)
            handle, offset, uuid = lender.stdout.readline().split()
            target = peer.Target(bytes.fromhex(handle), int(offset), bytes.fromhex(uuid), blocks_total)
            mapper = Mapper()
            shape = (blocks_total, block // 2)
            mapped[device] = {"push": mapper.tensor(target, shape, torch.int16, torch.device("cuda:0")),
                              "pull": mapper.tensor(target, shape, torch.int16, torch.device(f"cuda:{device}"))}
        blockcopy._peer_access(1, 0)  # the pull kernel reads GPU 0's cache
        generator = torch.Generator().manual_seed(1)
        for size in sizes:
            n = size // block
            for device in (0, 1):
                for method in ("push", "pull", "copy engine"):
                    if device == 0 and method == "pull":
                        continue
                    times = []
                    for repeat in range(args.repeats + 2):
                        src_ids = torch.randperm(blocks_total, generator=generator)[:n]
                        dst_ids = torch.randperm(blocks_total, generator=generator)[:n]
                        dst = mapped[device]["pull" if method == "pull" else "push"]
                        run_on = dst.device if method == "pull" else src.device
                        s_ids, d_ids = src_ids.to(run_on), dst_ids.to(run_on)
                        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
                        start = time.perf_counter()
                        if method == "copy engine":
                            blockcopy.copy_listed(src, tuple(src_ids.tolist()), dst,
                                                  tuple(dst_ids.tolist()))
                        elif method == "pull":
                            with torch.cuda.device(run_on):
                                blockcopy._launch(src, s_ids, dst, d_ids, on=run_on)  # read from GPU 0 by GPU 1
                        else:
                            blockcopy.copy_blocks(src, s_ids, dst, d_ids)
                        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
                        if repeat >= 2:
                            times.append(time.perf_counter() - start)
                        sample = torch.randint(0, n, (4,), generator=generator)
                        got = dst[d_ids[sample].to(dst.device)].cpu()
                        want = src[src_ids[sample].to(src.device)].cpu()
                        assert torch.equal(got, want), (size, device, method)
                    times.sort()
                    row = {"size": size, "dst_gpu": device, "method": method, "blocks": n,
                           "median_ms": statistics.median(times) * 1e3,
                           "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3}
                    row["gb_s"] = size / (row["median_ms"] / 1e3) / 1e9
                    rows.append(row)
                    print(f"{size >> 20:>6} MiB  GPU0->GPU{device}  {method:<12} {row['median_ms']:9.3f} ms "
                          f"p90 {row['p90_ms']:9.3f}  {row['gb_s']:7.1f} GB/s  exact", flush=True)
    finally:
        for lender in lenders:
            lender.stdin.close()
            lender.wait(timeout=30)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "block_bytes": block,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
