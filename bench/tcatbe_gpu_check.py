"""tca-tbe on a GPU: bit-exactness against the CPU reference, then timings
beside a plain copy (the roofline) and SplitZip.

    python bench/tcatbe_gpu_check.py [--gib 1] [--repeats 20] [--json out.json]

Data: the real SmolLM2 KV sample (chunk 1, bf16) tiled to ``--gib`` GiB. Checks: the small-input
checks of ``tests/codec/tcatbe_kernel_checks.py`` (every BF16 pattern, specials, corrupt frames,
blocks; every decode path), the kernels' frame of a ``--reference-gib`` prefix equals the numpy
reference's byte for byte, and every timed decode is bit-exact on the whole tensor first. Decode
paths: the Triton kernels and the CUDA ones (``--cuda-configs``), whole tensors and
``decode_blocks`` into randomly placed cache blocks. GB/s counts uncompressed BF16 bytes; times
are medians of CUDA-event timings, host waits included.
The decode target on H200 is 1,500 GB/s of BF16 output.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry import codec  # noqa: E402
from kvferry.codec import tcatbe  # noqa: E402
from bench.codec_bench import kv_source, tile  # noqa: E402
from kvferry.codec.tcatbe import cuda, gpu  # noqa: E402


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


def cuda_config(config: str, default: dict) -> tuple[dict, int]:
    """(cuda.TUNING, cuda.RUNS) of a --cuda-configs entry such as ``6x8``, ``6x8w`` or ``6x8b5c2``:
    blocks per SM x bytes a lane takes per span, then w: write-back stores, not evict-first; bN: N
    blocks per SM with block ids; cK: K tiles a check thread takes. Unnamed: the defaults."""
    m = re.fullmatch(r"(\d+)x(\d+)(w?)(?:b(\d+))?(?:c(\d+))?", config)
    assert m, f"bad CUDA configuration {config!r}"
    tuning = {**default, "MINB": int(m[1]), "STORE_CS": int(not m[3])}
    if m[4]:
        tuning["MINB_BLOCKS"] = int(m[4])
    if m[5]:
        tuning["CHECK_TILES"] = int(m[5])
    return tuning, int(m[2])


def kernel_times(call, repeats: int) -> dict:
    """Median GPU milliseconds of each kernel ``call`` launches through cuda._launch (events
    after each launch, the GPU kept busy beforehand so that the host runs ahead), the host's
    milliseconds from the call to its first launch, and from there to its last."""
    launch, marks = cuda._launch, []

    def traced(device_index, name, *rest):
        launch(device_index, name, *rest)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event, time.perf_counter()))

    samples: dict[str, list[float]] = {}
    cuda._launch = traced
    try:
        for _ in range(repeats):
            marks.clear()
            torch.cuda._sleep(2_000_000)
            first = torch.cuda.Event(enable_timing=True)
            first.record()
            started = time.perf_counter()
            call()
            torch.cuda.synchronize()
            before = first
            for name, event, _ in marks:
                samples.setdefault(name, []).append(before.elapsed_time(event))
                before = event
            samples.setdefault("host to first launch", []).append((marks[0][2] - started) * 1e3)
            samples.setdefault("host first to last launch", []).append((marks[-1][2] - marks[0][2]) * 1e3)
    finally:
        cuda._launch = launch
    return {name: statistics.median(v) for name, v in samples.items()}


def row(name: str, raw: int, wire: int | None, t_enc: float | None, t_dec: float | None, note: str = "") -> dict:
    r = {"codec": name, "raw_bytes": raw, "wire_bytes": wire, "ratio": raw / wire if wire else None,
         "encode_gbps": raw / t_enc / 1e9 if t_enc else None, "decode_gbps": raw / t_dec / 1e9 if t_dec else None,
         "note": note}
    fmt = lambda v: f"{v:8.1f}" if v else "       -"  # noqa: E731
    print(f"{name:44s} ratio {r['ratio'] or 0:6.3f}  enc {fmt(r['encode_gbps'])} GB/s  dec {fmt(r['decode_gbps'])} GB/s"
          f"  {note}", flush=True)
    return r


def bench_blocks(x: torch.Tensor, shape: tuple[int, ...], repeats: int, config: str = "",
                 triton: bool = True) -> list[dict]:
    """decode_blocks of the data cut into blocks of ``shape`` into a cache twice as large, at
    random places: the CUDA path (straight into the blocks; CUDA configuration ``config``, for
    the label) and, with ``triton``, decode-then-scatter."""
    block_elems = 1
    for dim in shape:
        block_elems *= dim
    count = x.numel() // block_elems
    blocks = x[:count * block_elems].view(count, *shape)
    raw = blocks.numel() * 2
    c = codec.get("tca-tbe")
    ids = torch.randperm(2 * count, device=x.device)[:count]
    frame = c.encode_blocks(blocks, torch.arange(count, device=x.device))
    cache = torch.zeros(2 * count, *shape, dtype=torch.bfloat16, device=x.device)
    rows, default = [], gpu.DECODE_CUDA
    for use_cuda in ([True] if cuda.available() else []) + ([False] if triton else []):
        gpu.DECODE_CUDA = use_cuda
        how = f"CUDA into blocks{' ' + config if config else ''}" if use_cuda else "Triton + scatter"
        label = f"tca-tbe decode_blocks {list(shape)} x {count}, {how}"
        try:
            cache.zero_()
            c.decode_blocks(frame, cache, ids)
            assert torch.equal(cache[ids].view(torch.int16), blocks.view(torch.int16)), f"{label}: not bit-exact"
            t_dec = cuda_time(lambda: c.decode_blocks(frame, cache, ids), repeats)
            extra = kernel_times(lambda: c.decode_blocks(frame, cache, ids), repeats) if use_cuda else {}
        except Exception as exc:
            print(f"{label}: FAILED {type(exc).__name__}: {exc}"[:2000], flush=True)
            continue
        finally:
            gpu.DECODE_CUDA = default
        note = "GPU ms: " + ", ".join(f"{k} {v:.3f}" for k, v in extra.items()) if extra else ""
        rows.append({**row(label, raw, frame.numel(), None, t_dec, note), **extra})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--configs", default="16x4",
                        help="encode kernel configurations to time: tiles per program x warps")
    parser.add_argument("--decode-configs", default="16x4",
                        help="Triton decode kernel configurations to time, tiles x warps[x runs a program][w: the "
                        "word kernel]")
    parser.add_argument("--cuda-configs", default="6x8,6x16,5x8,6x8c2",
                        help="CUDA decode configurations (kvferry/codec/tcatbe/cuda.py, when CuPy is there): "
                        "blocks per SM x bytes a lane takes per span [w: write-back stores, not evict-first; bN: N "
                        "blocks per SM with block ids; cK: K tiles a check thread takes]")
    parser.add_argument("--check-configs", default="",
                        help="Triton check kernel configurations to time (the Triton decode's first pass)")
    parser.add_argument("--block-shapes", default="30x2x16x3x64,2x16x8x128",
                        help="cache block shapes for decode_blocks into randomly placed blocks (real KV tiled)")
    parser.add_argument("--block-configs", default="",
                        help="CUDA configurations (as --cuda-configs) to time decode_blocks with; default: the "
                        "fastest decode configuration")
    parser.add_argument("--skip-reference", action="store_true", help="skip the CPU byte comparison")
    parser.add_argument("--reference-gib", type=float, default=0.25,
                        help="GiB of the data (a prefix) whose GPU frame is compared with the CPU reference's")
    parser.add_argument("--crc", action="store_true", help="also time frames with the stream CRC (host copy)")
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

    checks = "passed"
    try:
        check_kernels(args.device)
    except Exception as exc:  # keep the timings: each decode variant is checked bit-exact on the data too
        checks = f"FAILED: {type(exc).__name__}: {exc}"[:3000]
        print(f"kernel checks {checks}", flush=True)
    frame = gpu.encode(x, checksum=False) if dev.type == "cpu" else tcatbe.encode(x, checksum=False)
    assert frame.device == x.device and frame[6].item() == tcatbe.FRAME_ID
    out = torch.empty_like(x)
    tcatbe.decode(frame, out=out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16)), "GPU round trip is not bit-exact"
    if not args.skip_reference:
        started = time.perf_counter()
        m = min(n, int(args.reference_gib * (1 << 30)) // 2 // 64 * 64)
        ref = tcatbe.encode_reference(x_cpu[:m], checksum=False)
        same = torch.equal(ref, tcatbe.encode(x[:m], checksum=False).cpu())
        print(f"GPU frame == CPU reference frame on the first {m * 2 / 2**30:.2f} GiB: {same} "
              f"({time.perf_counter() - started:.0f} s on the CPU)")
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

    def timed_decode(label: str) -> dict | None:
        """Bit-exact check, then the public call, the call given the host-parsed header, and
        (CUDA) the check pass alone and each kernel's GPU time."""
        try:
            out.zero_()
            tcatbe.decode(frame, out=out)
            assert torch.equal(out.view(torch.int16), x.view(torch.int16)), f"{label}: decode not bit-exact"
            t_dec = cuda_time(lambda: tcatbe.decode(frame, out=out), args.repeats)
            t_kernels = cuda_time(lambda: gpu.decode_into(frame, header, out), args.repeats)
            note = f"given the parsed header: {raw / t_kernels / 1e9:.0f} GB/s ({t_kernels * 1e3:.3f} ms)"
            extra = {}
            if gpu.DECODE_CUDA and cuda.available():
                t_check = cuda_time(lambda: cuda.check(frame, header), args.repeats)
                extra = {"check_ms": t_check * 1e3, **kernel_times(lambda: tcatbe.decode(frame, out=out), args.repeats)}
                note += (f"; check pass alone {t_check * 1e3:.3f} ms; GPU ms: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in extra.items() if k != "check_ms"))
        except Exception as exc:  # a variant that fails to build or run is reported, not fatal
            print(f"{label}: FAILED {type(exc).__name__}: {exc}"[:2000], flush=True)
            return None
        rows.append({**row(label, raw, frame.numel(), None, t_dec, note), **extra})
        return rows[-1]

    default = gpu.DECODE_CUDA, gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS, gpu.DECODE_BYTES
    gpu.DECODE_CUDA = False
    for config in filter(None, args.decode_configs.split(",")):
        gpu.DECODE_BYTES = not config.endswith("w")  # w: the kernel that takes a tile as two 32-bit words
        gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS = (
            [int(v) for v in config.rstrip("w").split("x")] + [1])[:3]
        timed_decode(f"tca-tbe decode, Triton {config} (tiles x warps x runs)")
    gpu.DECODE_CUDA, gpu.DECODE_TILES_PER_PROGRAM, gpu.DECODE_NUM_WARPS, gpu.DECODE_ITERS, gpu.DECODE_BYTES = default
    best = None
    if cuda.available():
        tuning, runs = dict(cuda.TUNING), cuda.RUNS
        for config in filter(None, args.cuda_configs.split(",")):
            cuda.TUNING, cuda.RUNS = cuda_config(config, tuning)
            timed = timed_decode(f"tca-tbe decode, CUDA {config} (blocks per SM x bytes per span)")
            if timed and (best is None or timed["decode_gbps"] > best[1]):
                best = (config, timed["decode_gbps"])
        cuda.TUNING, cuda.RUNS = tuning, runs
        if best:  # the rows below (defaults, blocks) run the fastest one
            cuda.TUNING, cuda.RUNS = cuda_config(best[0], tuning)
        print(f"fastest CUDA decode configuration (used below): {best}", flush=True)
    else:
        print("CuPy is not importable: no CUDA decode", flush=True)
    t_enc = cuda_time(lambda: tcatbe.encode(x, checksum=False), args.repeats)
    t_dec = cuda_time(lambda: tcatbe.decode(frame, out=out), args.repeats)
    rows.append(row("tca-tbe (defaults; CUDA decode: the fastest configuration)", raw, frame.numel(), t_enc, t_dec))
    if cuda.available():
        t_check = cuda_time(lambda: cuda.check(frame, header), args.repeats)
        print(f"  CUDA check pass alone: {t_check * 1e3:.3f} ms (host wait included)", flush=True)
    default = gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS, gpu.DECODE_CUDA
    gpu.DECODE_CUDA = False
    for config in filter(None, args.check_configs.split(",")):
        gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS = (int(v) for v in config.split("x"))
        try:
            t_check = cuda_time(lambda: gpu.check(frame, header), args.repeats)
        except Exception as exc:
            print(f"check {config}: FAILED {type(exc).__name__}: {exc}"[:2000])
            continue
        print(f"  check pass alone, {config}: {t_check * 1e3:.3f} ms ({raw / t_check / 1e9:.0f} GB/s of "
              "output-equivalent, host wait included)", flush=True)
    gpu.CHECK_TILES_PER_PROGRAM, gpu.CHECK_NUM_WARPS, gpu.DECODE_CUDA = default
    if args.crc:
        crc_frame = tcatbe.encode(x, checksum=True)
        t_enc_crc = cuda_time(lambda: tcatbe.encode(x, checksum=True), max(3, args.repeats // 4))
        t_dec_crc = cuda_time(lambda: tcatbe.decode(crc_frame, out=out), max(3, args.repeats // 4))
        rows.append(row("tca-tbe with stream CRC32C (host copy)", raw, crc_frame.numel(), t_enc_crc, t_dec_crc,
                        "the CRC is computed on the host"))
    tuning, runs = dict(cuda.TUNING), cuda.RUNS
    configs = args.block_configs.split(",") if args.block_configs and cuda.available() else [""]
    for i, config in enumerate(configs):
        if config:
            cuda.TUNING, cuda.RUNS = cuda_config(config, tuning)
        for shape in filter(None, args.block_shapes.split(",")):
            rows += bench_blocks(x, tuple(int(v) for v in shape.split("x")), args.repeats, config, triton=i == 0)
        cuda.TUNING, cuda.RUNS = tuning, runs

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
                                               "triton": triton.__version__, "elements": n, "kernel_checks": checks,
                                               "fastest_cuda_decode": best, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
