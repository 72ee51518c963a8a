"""Entropy codec benchmark: ratios per dtype (real KV, K and V calibrated
separately on chunk 0 and measured on chunk 1; and the mixed K/V tile the GPU benchmark uses),
GPU bytes == CPU bytes, then whole-call GPU timings beside SplitZip and the copy roofline.

    python bench/entropy_gpu.py [--elements 256M] [--repeats 10] [--json out.json]

GB/s counts uncompressed bytes; times are medians of CUDA-event timings of the public call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry import codec  # noqa: E402
from kvferry.codec import entropy  # noqa: E402
from bench.codec_bench import SAMPLE, parse_size, tile  # noqa: E402
from kvferry.codec.entropy.codec import encode_reference  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


def _codec_gpu():
    spec = importlib.util.spec_from_file_location("codec_gpu", ROOT / "bench" / "codec_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_kv() -> dict[str, torch.Tensor]:
    """c{0,1}_{k,v}: [layers, heads, tokens, head_dim]; c{0,1}: [layers, 2, heads, tokens, head_dim]."""
    z = np.load(SAMPLE)
    out = {}
    for c in (0, 1):
        for kind in "kv":
            out[f"c{c}_{kind}"] = torch.stack([torch.from_numpy(z[f"c{c}_l{l}_{kind}"].view(np.int16)).view(torch.bfloat16)
                                               for l in range(30)])
        out[f"c{c}"] = torch.stack([out[f"c{c}_k"], out[f"c{c}_v"]], dim=1)
    return out


def ratios(kv: dict[str, torch.Tensor], tables: int) -> list[dict]:
    rows = []
    for dtype in DTYPES:
        for kind in ("k", "v"):
            book = entropy.calibrate(kv[f"c0_{kind}"].to(dtype), token_axis=2, tables=tables)
            data = kv[f"c1_{kind}"].to(dtype)
            frame = entropy.encode(data, book)
            assert torch.equal(entropy.decode(frame).view(torch.uint8), data.view(torch.uint8))
            sz = codec.encode(data, codec.calibrate(kv[f"c0_{kind}"].to(dtype)))
            raw = data.numel() * data.element_size()
            rows.append({"dtype": str(dtype).removeprefix("torch."), "kind": kind.upper(), "tables": book.tables,
                         "entropy_ratio": raw / frame.numel(), "splitzip_ratio": raw / sz.numel()})
    return rows


def print_table(rows: list[dict], width: int = 40) -> None:
    """Codec, ratio, encode and decode GB/s per row ("-" where not measured), and its note."""
    print(f"\n{'codec':<{width}}{'ratio':>8}{'enc GB/s':>11}{'dec GB/s':>11}  note")
    for r in rows:
        cells = [format(r[k], spec) if r.get(k) is not None else "-"
                 for k, spec in (("ratio", ".3f"), ("encode_gbps", ".1f"), ("decode_gbps", ".1f"))]
        print(f"{r['codec']:<{width}}{cells[0]:>8}{cells[1]:>11}{cells[2]:>11}  {r.get('note', '')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", default="256M")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tables", type=int, default=32)
    parser.add_argument("--check-elements", default="16M", help="prefix compared byte for byte with the CPU")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n = parse_size(args.elements)
    kv = real_kv()
    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "elements": n}
    result: dict = {"env": env}
    started = time.perf_counter()
    result["ratios"] = ratios(kv, args.tables)
    print(f"ratios ({time.perf_counter() - started:.1f} s, CPU reference):")
    for r in result["ratios"]:
        print(f"  {r['dtype']:<15}{r['kind']}  entropy {r['entropy_ratio']:.4f}  splitzip {r['splitzip_ratio']:.4f}"
              f"  ({r['tables']} tables)")
    if not torch.cuda.is_available():
        print("no CUDA: GPU part skipped")
        return
    cg = _codec_gpu()
    env["device"] = torch.cuda.get_device_name()
    print(json.dumps(env))
    data = kv["c1"].reshape(-1)
    rows: list[dict] = []
    done = 0
    for dtype in DTYPES:
        book = entropy.calibrate(kv["c0"].to(dtype), token_axis=3, tables=args.tables)  # [30, 2, 3, 511, 64]
        x = tile(data, n).to(dtype).cuda()
        m = min(n, parse_size(args.check_elements))
        started = time.perf_counter()
        same = torch.equal(entropy.encode(x[:m], book).cpu(), encode_reference(x[:m].cpu(), book))
        check_s = time.perf_counter() - started
        assert same, f"{dtype}: GPU frame != CPU frame"
        frame = entropy.encode(x, book, checksum=False)
        out = torch.empty_like(x)
        entropy.decode(frame, out=out)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), f"{dtype}: GPU round trip not bit-exact"
        raw = x.numel() * x.element_size()
        t_enc = cg.cuda_time(lambda: entropy.encode(x, book, checksum=False), args.repeats, 1)
        t_dec = cg.cuda_time(lambda: entropy.decode(frame, out=out), args.repeats, 1)
        rows.append(cg.row(f"entropy {str(dtype).removeprefix('torch.')}", raw, frame.numel(), t_enc, t_dec,
                           f"GPU==CPU bytes on {m} elements ({check_s:.1f} s)"))
        if dtype == torch.bfloat16:
            framec = entropy.encode(x, book)
            rows.append(cg.row("entropy bfloat16, stream CRC (host)", raw, framec.numel(),
                               cg.cuda_time(lambda: entropy.encode(x, book), 3, 1),
                               cg.cuda_time(lambda: entropy.decode(framec, out=out), 3, 1)))
            t_copy = cg.cuda_time(lambda: x.clone(), args.repeats)
            rows.append(cg.row("device copy (roofline)", raw, None, t_copy, t_copy, "GB/s of input"))
            rows.append(cg.bench_splitzip(x, codec.calibrate([kv["c0"].to(dtype)]), args.repeats, "splitzip bfloat16"))
        if dtype == torch.float8_e4m3fn:
            rows.append(cg.bench_splitzip(x, codec.calibrate([kv["c0"].to(dtype)]), args.repeats, "splitzip e4m3"))
        del x, frame, out
        torch.cuda.empty_cache()
        for r in rows[done:]:
            print(r)
        done = len(rows)
    result["rows"] = rows
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
