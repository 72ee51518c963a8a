"""tca-tbe on a GPU, one device call: bit-exactness against the CPU reference, then timings
beside a plain copy (the roofline) and SplitZip.

    python bench/tcatbe_gpu_check.py [--gib 1] [--repeats 20] [--json out.json]

Data: the real SmolLM2 KV sample (chunk 1, bf16) tiled to ``--gib`` GiB. Checks: the kernels'
frame equals the numpy reference's byte for byte and decodes bit-exactly (full size), and the
small-input checks of ``tests/codec/tcatbe_kernel_checks.py`` (every BF16 pattern, specials,
corrupt frames). GB/s counts uncompressed BF16 bytes; times are medians of CUDA-event timings.
The decode target on H200 is 1,500 GB/s of BF16 output.
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

from kvferry import codec  # noqa: E402
from kvferry.codec import tcatbe  # noqa: E402
from kvferry.codec.bench import kv_source, tile  # noqa: E402
from kvferry.codec.tcatbe import gpu  # noqa: E402


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` between CUDA events on the current stream (host waits included);
    wall clock on a machine without CUDA (``--device cpu``: a smoke run of this script)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    times = []
    for start, end in events:
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def row(name: str, raw: int, wire: int | None, t_enc: float | None, t_dec: float | None, note: str = "") -> dict:
    r = {"codec": name, "raw_bytes": raw, "wire_bytes": wire, "ratio": raw / wire if wire else None,
         "encode_gbps": raw / t_enc / 1e9 if t_enc else None, "decode_gbps": raw / t_dec / 1e9 if t_dec else None,
         "note": note}
    fmt = lambda v: f"{v:8.1f}" if v else "       -"  # noqa: E731
    print(f"{name:44s} ratio {r['ratio'] or 0:6.3f}  enc {fmt(r['encode_gbps'])} GB/s  dec {fmt(r['decode_gbps'])} GB/s"
          f"  {note}", flush=True)
    return r


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--configs", default="16x4",
                        help="encode kernel configurations to time: tiles per program x warps")
    parser.add_argument("--decode-configs", default="16x4,32x4,64x4,64x8,32x4x4,32x4w",
                        help="decode kernel configurations to time, tiles x warps[x runs a program][w: the "
                        "word kernel] (and the default's SWAR popcount)")
    parser.add_argument("--check-configs", default="128x4,256x4",
                        help="check kernel configurations to time (the decode's first pass)")
    parser.add_argument("--skip-reference", action="store_true", help="skip the full-size CPU byte comparison")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1, tiny --gib)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import triton

    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    assert dev.type != "cuda" or gpu.available(), "needs CUDA and triton"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {platform.python_version()}", flush=True)
    calib, data, source = kv_source()
    n = int(args.gib * (1 << 30)) // 2 // 64 * 64
    x_cpu = tile(data.to(torch.bfloat16), n)
    x = x_cpu.to(dev)
    raw = n * 2
    print(f"data: {source}, {n} elements ({raw / 2**30:.2f} GiB)", flush=True)

    # 1. Bit-exactness: small edge cases, then the full tensor against the numpy reference.
    from tests.codec.tcatbe_kernel_checks import check_kernels

    try:
        check_kernels(args.device)
    except Exception as exc:  # keep the timings of the rest: retry with the SWAR popcount
        print(f"kernel checks FAILED with popc={'asm' if gpu.POPC_ASM else 'swar'}: {type(exc).__name__}: {exc}"[:3000])
        if not gpu.POPC_ASM:
            raise
        gpu.POPC_ASM = False
        check_kernels(args.device)
    frame = gpu.encode(x, checksum=False) if dev.type == "cpu" else tcatbe.encode(x, checksum=False)
    assert frame.device == x.device and frame[6].item() == tcatbe.FRAME_ID
    out = torch.empty_like(x)
    tcatbe.decode(frame, out=out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16)), "GPU round trip is not bit-exact"
    if not args.skip_reference:
        started = time.perf_counter()
        ref = tcatbe.encode_reference(x_cpu, checksum=False)
        same = torch.equal(ref, frame.cpu())
        print(f"full-size GPU frame == CPU reference frame: {same} ({time.perf_counter() - started:.0f} s on the CPU)")
        assert same, "GPU bytes differ from the CPU reference"
        del ref
    header = tcatbe.read_header(frame)
    print(f"window {header.window_low}..{header.window_low + 6}, in window {header.in_window / n:.4f}", flush=True)

    # 2. Timings.
    rows = []
    t_copy = cuda_time(lambda: out.copy_(x), args.repeats)
    rows.append(row("copy (roofline: reads and writes raw bytes)", raw, raw, t_copy, t_copy))
    default = gpu.TILES_PER_PROGRAM, gpu.NUM_WARPS
    for config in args.configs.split(","):
        gpu.TILES_PER_PROGRAM, gpu.NUM_WARPS = (int(v) for v in config.split("x"))
        assert torch.equal(tcatbe.encode(x, checksum=False), frame), f"{config}: other bytes"
        t_enc = cuda_time(lambda: tcatbe.encode(x, checksum=False), args.repeats)
        rows.append(row(f"tca-tbe encode, {config} (tiles/program x warps)", raw, frame.numel(), t_enc, None))
    gpu.TILES_PER_PROGRAM, gpu.NUM_WARPS = default
    default = gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS, gpu.DECODE_BYTES, gpu.POPC_ASM
    variants = [(c, True) for c in args.decode_configs.split(",")]
    variants.append(("x".join(str(v) for v in default[:3]) + ("" if default[3] else "w"), False))
    for config, asm in variants:
        gpu.DECODE_BYTES = not config.endswith("w")  # w: the kernel that takes a tile as two 32-bit words
        gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS = (
            [int(v) for v in config.rstrip("w").split("x")] + [1])[:3]
        gpu.POPC_ASM = asm
        try:
            out.zero_()
            tcatbe.decode(frame, out=out)
            assert torch.equal(out.view(torch.int16), x.view(torch.int16)), f"{config}: decode not bit-exact"
            t_dec = cuda_time(lambda: tcatbe.decode(frame, out=out), args.repeats)
            t_dec_kernels = cuda_time(lambda: gpu.decode_into(frame, header, out), args.repeats)
        except Exception as exc:  # a variant that fails to build or run is reported, not fatal
            print(f"decode {config} popc={'asm' if asm else 'swar'}: FAILED {type(exc).__name__}: {exc}"[:2000])
            continue
        rows.append(row(f"tca-tbe decode, {config} popc {'asm' if asm else 'swar'} (tiles x warps x runs)", raw,
                        frame.numel(), None, t_dec, f"decode w/o header read: {raw / t_dec_kernels / 1e9:.0f} GB/s"))
    gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS, gpu.DECODE_BYTES, gpu.POPC_ASM = default
    t_enc = cuda_time(lambda: tcatbe.encode(x, checksum=False), args.repeats)
    t_dec = cuda_time(lambda: tcatbe.decode(frame, out=out), args.repeats)
    rows.append(row("tca-tbe (defaults)", raw, frame.numel(), t_enc, t_dec))
    default = gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS
    for config in args.check_configs.split(","):
        gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS = (int(v) for v in config.split("x"))
        try:
            t_check = cuda_time(lambda: gpu.check(frame, header), args.repeats)
        except Exception as exc:
            print(f"check {config}: FAILED {type(exc).__name__}: {exc}"[:2000])
            continue
        print(f"  check pass alone, {config}: {t_check * 1e3:.3f} ms ({raw / t_check / 1e9:.0f} GB/s of "
              "output-equivalent, host wait included)", flush=True)
    gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS = default
    crc_frame = tcatbe.encode(x, checksum=True)
    t_enc_crc = cuda_time(lambda: tcatbe.encode(x, checksum=True), max(3, args.repeats // 4))
    t_dec_crc = cuda_time(lambda: tcatbe.decode(crc_frame, out=out), max(3, args.repeats // 4))
    rows.append(row("tca-tbe with stream CRC32C (host copy)", raw, crc_frame.numel(), t_enc_crc, t_dec_crc,
                    "the CRC is computed on the host"))

    sz = codec.get("splitzip")
    book = sz.calibrate(calib.to(torch.bfloat16))
    sz_frame = sz.encode(x, book)
    sz.decode(sz_frame, book, out=out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16)), "splitzip round trip is not bit-exact"
    t_enc = cuda_time(lambda: sz.encode(x, book), args.repeats)
    t_dec = cuda_time(lambda: sz.decode(sz_frame, book, out=out), args.repeats)
    rows.append(row("splitzip (same run)", raw, sz_frame.numel(), t_enc, t_dec))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__,
                                               "triton": triton.__version__, "elements": n, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
