"""The ``kvferry`` command line. Heavy imports stay inside subcommands so ``--help`` is instant."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_SAMPLE = Path("tests/data/kv_smollm2_gpl3.npz")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("codec-demo", help="compress real (or synthetic) KV, check it round-trips bit-exactly")
    demo.add_argument("--data", type=Path, default=DEFAULT_SAMPLE,
                      help="KV sample (.npz of bf16 bit patterns); synthetic data if absent")
    demo.set_defaults(run=_codec_demo)

    cal = sub.add_parser("calibrate", help="build an exponent codebook from KV files")
    cal.add_argument("files", nargs="+", type=Path, help=".npz/.npy/.pt files")
    cal.add_argument("-o", "--output", type=Path, required=True, help="codebook JSON to write")
    cal.add_argument("--dtype", default="bfloat16",
                     help="element dtype; integer arrays of its width are read as bit patterns")
    cal.add_argument("--select", metavar="REGEX",
                     help="only arrays whose name matches, e.g. '_k$' for a K-only codebook")
    cal.set_defaults(run=_calibrate)

    args = parser.parse_args(argv)
    return args.run(args)


def _calibrate(args: argparse.Namespace) -> int:
    import codec

    from .kvfiles import load_tensors

    tensors = [t for path in args.files for _, t in load_tensors(path, args.dtype, args.select)]
    if not tensors:
        print("kvferry calibrate: no arrays matched", file=sys.stderr)
        return 2
    book = codec.calibrate(tensors)
    args.output.write_text(book.to_json() + "\n")
    print(f"{len(tensors)} arrays, {book.samples} {book.dtype} values: coverage {book.coverage:.4%}, "
          f"exponents {list(book.exponents)} -> {args.output}")
    return 0


def _codec_demo(args: argparse.Namespace) -> int:
    import time

    import torch

    import codec

    from .kvfiles import load_tensors

    if args.data.exists():
        arrays = dict(load_tensors(args.data, "bfloat16"))
        calib = [t for name, t in arrays.items() if name.startswith("c0_")]
        data = torch.cat([t.reshape(-1) for name, t in arrays.items() if name.startswith("c1_")])
        source = f"{args.data} (codebook calibrated on chunk 0, applied to chunk 1)"
    else:
        gen = torch.Generator().manual_seed(0)
        calib = [torch.randn(1 << 20, generator=gen).to(torch.bfloat16)]
        data = torch.randn(1 << 22, generator=gen).to(torch.bfloat16)
        source = "synthetic Gaussian data (no KV sample found)"
    print(f"kvferry codec demo on {source}, CPU reference path\n")
    print(f"{'dtype':<15}{'MB':>8}{'ratio':>8}{'escapes':>10}{'enc GB/s':>10}{'dec GB/s':>10}  bit-exact")
    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        x = data.to(dtype)
        book = codec.calibrate([t.to(dtype) for t in calib])
        start = time.perf_counter()
        frame = codec.encode(x, book)
        mid = time.perf_counter()
        y = codec.decode(frame)
        end = time.perf_counter()
        exact = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        ok &= exact
        raw = x.numel() * x.element_size()
        header = codec.read_header(frame)
        print(f"{header.layout.name:<15}{raw / 1e6:>8.1f}{raw / frame.numel():>8.3f}{header.escapes:>10}"
              f"{raw / (mid - start) / 1e9:>10.3f}{raw / (end - mid) / 1e9:>10.3f}  {'yes' if exact else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
