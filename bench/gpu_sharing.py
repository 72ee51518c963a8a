"""What a sidecar's GPU work waits for when another process uses the same GPU: one 2 MiB device
copy, launched and waited for in this process, while another process on the GPU is idle, has
just run one small kernel, or keeps the GPU busy with matrix products (as an inference engine
beside its sidecar does).

    python bench/gpu_sharing.py [--rounds 2] [--n 300] [--json FILE]

Without CUDA MPS the GPU runs one process's work at a time (time slices), so the copy waits for
the other process's turn to end; under MPS both run at once. Run it once as it is and once under
an MPS daemon (as root: ``export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps
CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; nvidia-cuda-mps-control -d``; afterwards
``echo quit | nvidia-cuda-mps-control``). It prints which of the two it found.
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

_OTHER = r"""
import sys, threading, torch
x = torch.zeros(1024, device="cuda:0")
a = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16)
busy = threading.Event()


def work():
    while True:
        busy.wait()
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


threading.Thread(target=work, daemon=True).start()
for line in sys.stdin:
    command = line.strip()
    if command == "kernel":
        x.add_(1)
        torch.cuda.synchronize()
    elif command == "busy":
        busy.set()
    elif command == "idle":
        busy.clear()
        torch.cuda.synchronize()
    print("ok", flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch

    from kvferry.engine.placement import gpu_sharing

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    other = subprocess.Popen([sys.executable, "-c", _OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def tell(command: str) -> None:
        other.stdin.write(command + "\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "ok"

    src = torch.randint(0, 255, (16, 2 << 20), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    stream = torch.cuda.Stream("cuda:0")

    def copy(i: int) -> float:
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            dst[i % 16].copy_(src[(i * 7) % 16], non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - started

    try:
        tell("idle")
        for i in range(50):
            copy(i)
        rows: dict[str, list[list[float]]] = {"idle": [], "after one kernel": [], "busy": []}
        for _ in range(args.rounds):
            rows["idle"].append([copy(i) for i in range(args.n)])
            after = []
            for i in range(args.n):
                tell("kernel")
                after.append(copy(i))
            rows["after one kernel"].append(after)
            tell("busy")
            time.sleep(0.2)
            rows["busy"].append([copy(i) for i in range(args.n)])
            tell("idle")
        ok = torch.equal(dst[(args.n - 1) % 16].cpu(), src[((args.n - 1) * 7) % 16].cpu())
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    sharing = gpu_sharing()
    names = {"idle": "idle", "after one kernel": "has just run one small kernel",
             "busy": "runs matrix products without a pause"}
    result = {"device": torch.cuda.get_device_name(0), "sharing": sharing, "bit_exact": ok,
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(f"{result['device']}, GPU shared by {sharing}; one 2 MiB copy, launch + wait, µs")
    print("| the other process | median, each round | p90, each round |")
    print("|---|---:|---:|")
    for key, rounds in rows.items():
        medians = [statistics.median(r) * 1e6 for r in rounds]
        p90s = [sorted(r)[int(0.9 * (len(r) - 1))] * 1e6 for r in rounds]
        result["rows"].append({"other": key, "median_us": medians, "p90_us": p90s})
        print(f"| {names[key]} | {', '.join(f'{m:.1f}' for m in medians)} | {', '.join(f'{p:.1f}' for p in p90s)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
