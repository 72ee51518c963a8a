"""Codec benchmark: ``python bench/codec_bench.py [--sizes 1M,16M] [--threads N] [--json out.json]``.

Times the CPU reference (and, with ``--gpu``, the GPU path; see bench/codec_gpu.py for the full
GPU run with nvCOMP) against a plain copy, on real KV tiled to size when the sample is present.
GB/s counts uncompressed bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.codec import calibrate, decode, encode, read_header  # noqa: E402

SAMPLE = ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz"
DTYPES = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


def kv_source() -> tuple[torch.Tensor, torch.Tensor, str]:
    """(calibration data, benchmark data) as float32, and where they came from."""
    if SAMPLE.exists():
        import numpy as np

        z = np.load(SAMPLE)
        def chunk(c: int) -> torch.Tensor:
            parts = [torch.from_numpy(z[f"c{c}_l{l}_{kind}"].view(np.int16)).view(torch.bfloat16).reshape(-1)
                     for l in range(30) for kind in "kv"]
            return torch.cat(parts).float()
        return chunk(0), chunk(1), f"real KV ({SAMPLE.name}), calibrated on chunk 0"
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1 << 20, generator=gen), torch.randn(1 << 22, generator=gen), "synthetic Gaussian"


def tile(x: torch.Tensor, n: int) -> torch.Tensor:
    reps = (n + x.numel() - 1) // x.numel()
    return x.repeat(reps)[:n]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1M,8M", help="element counts, e.g. 1M,8M")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: per core)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    calib, data, source = kv_source()
    print(f"codec CPU benchmark: {source}; {args.threads} thread(s); {platform.processor() or platform.machine()}; "
          f"torch {torch.__version__}")
    print(f"{'dtype':<15}{'elements':>10}{'ratio':>8}{'copy GB/s':>11}{'enc GB/s':>10}{'dec GB/s':>10}")
    rows = []
    for n in (parse_size(s) for s in args.sizes.split(",")):
        for dtype in DTYPES:
            x = tile(data, n).to(dtype)
            book = calibrate([calib.to(dtype)])
            frame = encode(x, book)
            assert torch.equal(decode(frame).view(torch.uint8), x.view(torch.uint8)), "not bit-exact"
            raw = x.numel() * x.element_size()
            t_copy = timed(lambda: x.clone(), args.repeats)
            t_enc = timed(lambda: encode(x, book), args.repeats)
            t_dec = timed(lambda: decode(frame), args.repeats)
            row = {"dtype": read_header(frame).layout.name, "elements": n, "ratio": raw / frame.numel(),
                   "copy_gbps": raw / t_copy / 1e9, "encode_gbps": raw / t_enc / 1e9,
                   "decode_gbps": raw / t_dec / 1e9, "threads": args.threads}
            rows.append(row)
            print(f"{row['dtype']:<15}{n:>10}{row['ratio']:>8.3f}{row['copy_gbps']:>11.2f}"
                  f"{row['encode_gbps']:>10.3f}{row['decode_gbps']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
