"""lowrank on a GPU: the Triton kernels against the CPU reference on real KV, then their speed.

    python bench/lowrank_gpu_check.py [--mib 256] [--energy 0.99] [--quantize k8v4] [--repeat 20]

Calibrates on chunk 0 of the shipped SmolLM2 KV, tiles chunk 1's blocks ([layer, kv, head,
73 tokens, channel]) to about ``--mib`` MiB, and checks that the GPU frame is byte-identical to
the CPU reference's and that both decoders reconstruct the same bits (exit status 1 if not).
Then it reports medians over ``--repeat`` runs (CUDA events) of GB/s of input bytes: the encode
and decode kernels alone, the whole ``encode``/``decode`` (which add the stream CRC on a host
copy), and a plain device copy (the roofline); with ratio, error, device and versions.
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

AXES = ("layer", "kv", "head", "token", "channel")


def load_chunk(z, c: int):
    import numpy as np
    import torch

    return torch.stack([torch.stack([torch.from_numpy(z[f"c{c}_l{l}_{kv}"].view(np.int16)).view(torch.bfloat16)
                                     for kv in "kv"]) for l in range(30)])


def timed(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` runs, by CUDA events, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="input size to tile to (MiB, 256..1024 is the plan)")
    parser.add_argument("--energy", type=float, default=0.99)
    parser.add_argument("--quantize", choices=("k8v4",))
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-cpu", action="store_true", help="no CPU comparison (speed only)")
    args = parser.parse_args()

    import numpy as np
    import torch
    import triton

    from kvferry.codec import lowrank
    from kvferry.codec.layout import BlockLayout
    from kvferry.codec.lowrank import codec as lc
    from kvferry.codec.lowrank import gpu

    if not gpu.available():
        print("needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    z = np.load(ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz")
    book = lowrank.calibrate(load_chunk(z, 0).to(dtype), axes=AXES, energy=args.energy, quantize=args.quantize)
    x1 = load_chunk(z, 1).to(dtype)[:, :, :, :511 // 73 * 73]
    blocks = x1.reshape(30, 2, 3, 7, 73, 64).permute(3, 0, 1, 2, 4, 5).contiguous()  # 7 blocks
    per_block = blocks[0].numel() * blocks.element_size()
    n = max(1, args.mib * 2**20 // per_block)
    x = blocks.repeat(-(-n // 7), 1, 1, 1, 1, 1)[:n].contiguous()
    bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
    raw = x.numel() * x.element_size()
    xd = x.cuda()

    ok = True
    t0 = time.perf_counter()
    frame_d = lowrank.encode(xd, bound)
    y_d = lowrank.decode(frame_d, bound)
    torch.cuda.synchronize()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": args.dtype, "energy": args.energy, "quantize": args.quantize, "blocks": n,
              "input_mib": round(raw / 2**20, 1), "ratio": round(raw / frame_d.numel(), 4),
              "mean_rank": round(float(book.ranks.mean()), 2)}
    err = (y_d.float() - xd.float())
    result["rel_rmse"] = round(float(err.pow(2).sum().sqrt() / xd.float().pow(2).sum().sqrt()), 5)
    if not args.skip_cpu:
        frame_c = lowrank.encode(x, bound)
        result["bytes_equal"] = bool(torch.equal(frame_d.cpu(), frame_c))
        y_c = lowrank.decode(frame_c, bound)
        result["values_equal"] = bool(torch.equal(y_d.cpu().view(torch.int16), y_c.view(torch.int16)))
        if not result["bytes_equal"]:
            diff = (frame_d.cpu() != frame_c).nonzero()
            result["first_byte_diff"] = int(diff[0]) if diff.numel() else -1
        ok = result["bytes_equal"] and result["values_equal"]
        result["cpu_check_s"] = round(time.perf_counter() - t0, 1)
    del y_d, err

    _, p = lc._plan_for(tuple(xd.shape), bound)
    xg = xd.permute(p.perm).reshape(p.groups, p.vectors, p.channels).contiguous()
    params, coefs = gpu.encode_streams(xg, book)
    gbs = lambda ms: round(raw / (ms * 1e-3) / 1e9, 2)  # noqa: E731
    result["encode_kernel_GBps"] = gbs(timed(lambda: gpu.encode_streams(xg, book), args.repeat))
    result["decode_kernel_GBps"] = gbs(timed(lambda: gpu.decode_streams(params, coefs, book, p.vectors, dtype),
                                             args.repeat))
    result["encode_frame_GBps"] = gbs(timed(lambda: lowrank.encode(xd, bound), max(3, args.repeat // 4)))
    result["decode_frame_GBps"] = gbs(timed(lambda: lowrank.decode(frame_d, bound), max(3, args.repeat // 4)))
    result["copy_GBps"] = gbs(timed(lambda: xd.clone(), args.repeat))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
