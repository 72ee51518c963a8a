"""GPU codec benchmark: bit-exactness, then timings against copy and nvCOMP.

    python bench/codec_gpu.py [--elements 256M] [--repeats 20] [--json results.json]

Data: the real SmolLM2 KV sample (tests/data), codebook calibrated on chunk 0, chunk 1 tiled to
the requested size. GB/s counts uncompressed bytes; the copy row counts input bytes too (a copy
reads and writes, so its bytes moved are twice that). Times are medians of CUDA-event timings of
the whole public call (host synchronization included) after warm-up.
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
from bench.codec_bench import kv_source, parse_size, tile  # noqa: E402
from kvferry.codec.frames import _encode  # noqa: E402

BLOCK_BYTES = 16 * 1024


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` measured with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    # torch creates a CUDA event at its first record: record every pair once here, so that the
    # end event's creation does not land inside the timed interval.
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        end.record()
    torch.cuda.synchronize()
    times = []
    for start, end in events:
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_times(fn, calls: int = 10) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel that `calls` calls of fn run (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            name = event.key.split("(")[0][:40]
            times[name] = times.get(name, 0.0) + event.device_time_total / calls
    return times


def row(name: str, raw: int, wire: int | None, t_enc: float | None, t_dec: float | None, note: str = "") -> dict:
    return {"codec": name, "raw_bytes": raw, "wire_bytes": wire,
            "ratio": raw / wire if wire else None,
            "encode_gbps": raw / t_enc / 1e9 if t_enc else None,
            "decode_gbps": raw / t_dec / 1e9 if t_dec else None, "note": note}


def bench_splitzip(x: torch.Tensor, book: codec.Codebook, repeats: int, label: str) -> dict:
    frame = codec.encode(x, book)
    out = torch.empty_like(x)
    codec.decode(frame, out=out)
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), f"{label}: GPU round trip not bit-exact"
    t_enc = cuda_time(lambda: codec.encode(x, book), repeats)
    t_dec = cuda_time(lambda: codec.decode(frame, out=out), repeats)
    return row(label, x.numel() * x.element_size(), frame.numel(), t_enc, t_dec)


def bench_kernels_only(x: torch.Tensor, book: codec.Codebook) -> dict:
    """GB/s over the GPU time of the kernels alone (the torch profiler's, memset and the final
    read included), as the SplitZip paper times its codec: what back-to-back calls reach when
    the host keeps ahead of the GPU."""
    frame = codec.encode(x, book)
    out = torch.empty_like(x)
    t_enc = sum(kernel_times(lambda: codec.encode(x, book)).values()) / 1e6
    t_dec = sum(kernel_times(lambda: codec.decode(frame, out=out)).values()) / 1e6
    return row("splitzip bf16, GPU time of its kernels", x.numel() * 2, frame.numel(), t_enc, t_dec,
               "no host time: the paper's measure")


def profile_calls(x: torch.Tensor, book: codec.Codebook) -> None:
    """Where the time of one encode and one decode goes: kernels vs everything else."""
    from torch.profiler import ProfilerActivity, profile

    frame = codec.encode(x, book)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    for label, fn in (("encode", lambda: codec.encode(x, book)), ("decode", lambda: codec.decode(frame, out=out))):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"--- profile: 5 x {label} ---")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


def host_timeline(x: torch.Tensor, book: codec.Codebook, calls: int = 20) -> None:
    """When, within one call, the host reaches each kernel launch and each device read, and
    when the call returns (µs from the call's start, medians): the GPU idles until the first
    launch and from its last kernel until the next call's first launch."""
    from kvferry.codec import staging
    from kvferry.codec.splitzip import gpu as splitzip_gpu

    marks: list[tuple[str, float]] = []
    launch, read = splitzip_gpu._Kernel.__call__, staging.read_to_host

    def timed_launch(self, *args, **kwargs):
        marks.append(("launch", time.perf_counter()))
        return launch(self, *args, **kwargs)

    def timed_read(*args, **kwargs):
        marks.append(("read", time.perf_counter()))
        result = read(*args, **kwargs)
        marks.append(("read done", time.perf_counter()))
        return result

    frame = codec.encode(x, book)
    out = torch.empty_like(x)
    splitzip_gpu._Kernel.__call__ = timed_launch
    splitzip_gpu.read_to_host = codec.frames.read_to_host = timed_read
    try:
        for label, fn in (("encode", lambda: codec.encode(x, book)), ("decode", lambda: codec.decode(frame, out=out))):
            rows = []
            for _ in range(calls):
                torch.cuda.synchronize()
                marks.clear()
                started = time.perf_counter()
                fn()
                ended = time.perf_counter()
                rows.append([(name, (t - started) * 1e6) for name, t in marks] + [("return", (ended - started) * 1e6)])
            steps = ", ".join(f"{name} {statistics.median(r[i][1] for r in rows):.0f}"
                              for i, (name, _) in enumerate(rows[0]))
            print(f"host timeline, {label} of {x.numel() >> 20}M elements, µs from the call's start: {steps}")
    finally:
        splitzip_gpu._Kernel.__call__ = launch
        splitzip_gpu.read_to_host = codec.frames.read_to_host = read


def host_profile(x: torch.Tensor, book: codec.Codebook, chunk_bytes: int = 64 << 20, calls: int = 50) -> None:
    """Per-call cost of the sidecar's codec calls (``encode_blocks``/``decode_blocks`` of one
    pipeline chunk of 16 KiB blocks): wall clock per synchronized call against GPU time, and
    the Python functions that take the host's time."""
    import cProfile
    import pstats

    per_block = BLOCK_BYTES // x.element_size()
    blocks = chunk_bytes // BLOCK_BYTES
    cache = x[: 2 * blocks * per_block].view(2 * blocks, per_block)
    ids = torch.randperm(2 * blocks, device=x.device)[:blocks]
    frame = codec.encode_blocks(cache, ids, book)
    dst = torch.zeros_like(cache)
    for label, fn in (("encode_blocks", lambda: codec.encode_blocks(cache, ids, book)),
                      ("decode_blocks", lambda: codec.decode_blocks(frame, dst, ids))):
        gpu = cuda_time(fn, calls)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / calls
        print(f"--- host profile: {label}, {chunk_bytes >> 20} MiB: {wall * 1e6:.0f} us/call wall "
              f"({chunk_bytes / wall / 1e9:.0f} GB/s), {gpu * 1e6:.0f} us between events ---")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
        if label == "decode_blocks":
            _time_decode_steps(frame, dst, ids, calls)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


SWEEP = [  # variants of splitzip_cuda.cu (TUNING), over the default (the first row)
    {}, {"LOAD_HINT": 3}, {"LOAD_HINT": 2},
]


def sweep(x: torch.Tensor, book: codec.Codebook, repeats: int, rounds: int = 2) -> None:
    """Encode/decode GB/s of each kernel variant, its frame byte-compared with the default's.
    Every variant is compiled and checked first, then timed in turns, round after round: the
    first variant timed on a fresh lease used to come out slow."""
    from kvferry.codec.splitzip import gpu as splitzip_gpu

    default = dict(splitzip_gpu.TUNING)
    reference = codec.encode(x, book)
    out = torch.empty_like(x)
    raw = x.numel() * x.element_size()
    same = {}
    speeds: dict[int, list[str]] = {i: [] for i in range(len(SWEEP))}
    try:
        for i, variant in enumerate(SWEEP):
            splitzip_gpu.TUNING = {**default, **variant}
            frame = codec.encode(x, book)
            out.zero_()
            codec.decode(reference, out=out)
            same[i] = torch.equal(frame, reference) and torch.equal(out.view(torch.int16), x.view(torch.int16))
        for _ in range(rounds):
            for i, variant in enumerate(SWEEP):
                splitzip_gpu.TUNING = {**default, **variant}
                t_enc = cuda_time(lambda: codec.encode(x, book), repeats)
                t_dec = cuda_time(lambda: codec.decode(reference, out=out), repeats)
                speeds[i].append(f"{raw / t_enc / 1e9:.0f} / {raw / t_dec / 1e9:.0f}")
    finally:
        splitzip_gpu.TUNING = default
    print(f"{'variant':<30}" + "".join(f"{'round ' + str(r + 1) + ' enc / dec':>22}" for r in range(rounds))
          + "  same bytes")
    for i, variant in enumerate(SWEEP):
        print(f"{str(variant or 'default'):<30}" + "".join(f"{v:>22}" for v in speeds[i]) + f"  {same[i]}")


def _time_decode_steps(frame: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, calls: int) -> None:
    """Wall time of decode_blocks' steps, each synchronized: where the host's time goes."""
    from kvferry.codec.splitzip import gpu as splitzip_gpu

    steps = {"read_header": 0.0, "decode_into": 0.0}
    for _ in range(calls):
        started = time.perf_counter()
        header = codec.read_header(frame)
        parsed = time.perf_counter()
        splitzip_gpu.decode_into(frame, header, dst, ids, dst[0].numel())
        torch.cuda.synchronize()
        steps["read_header"] += parsed - started
        steps["decode_into"] += time.perf_counter() - parsed
    print("decode_blocks steps, us/call: " + ", ".join(f"{k} {v / calls * 1e6:.0f}" for k, v in steps.items()))


def bench_blocks(x: torch.Tensor, book: codec.Codebook, repeats: int) -> dict:
    """16 KiB blocks: a cache twice the payload, every other block (shuffled) sent."""
    per_block = BLOCK_BYTES // x.element_size()
    blocks = x.numel() // per_block
    cache = torch.cat([x[: blocks * per_block]] * 2).view(2 * blocks, per_block)
    ids = torch.randperm(2 * blocks, device=x.device)[:blocks]
    frame = codec.encode_blocks(cache, ids, book)
    dst = torch.zeros_like(cache)
    codec.decode_blocks(frame, dst, ids)
    assert torch.equal(dst[ids].view(torch.uint8), cache[ids].view(torch.uint8)), "blocks not bit-exact"
    assert torch.equal(frame, codec.encode(cache[ids], book)), "encode_blocks differs from encode(cache[ids])"
    t_enc = cuda_time(lambda: codec.encode_blocks(cache, ids, book), repeats)
    t_dec = cuda_time(lambda: codec.decode_blocks(frame, dst, ids), repeats)
    return row(f"splitzip blocks ({BLOCK_BYTES // 1024} KiB)", blocks * BLOCK_BYTES, frame.numel(), t_enc, t_dec)


def bench_nvcomp(x: torch.Tensor, repeats: int) -> list[dict]:
    try:
        from nvidia import nvcomp
    except Exception as exc:  # the wheels were not carried
        return [row("nvCOMP", 0, None, None, None, f"not available: {exc}")]
    rows = []
    stream = torch.cuda.current_stream().cuda_stream
    data = nvcomp.as_array(x.view(torch.int16))
    configs = [("ANS", {"data_type": "<f2"}), ("ANS", {}), ("Bitcomp", {"data_type": "<u2"}),
               ("LZ4", {"data_type": "<u2"}), ("Cascaded", {"data_type": "<u2"}), ("GDeflate", {"algorithm_type": 0})]
    for algorithm, options in configs:
        label = f"nvCOMP {nvcomp.__version__} {algorithm} {options or ''}".strip()
        try:
            c = nvcomp.Codec(algorithm=algorithm, cuda_stream=stream, **options)
            enc = c.encode(data)
            dec = torch.as_tensor(c.decode(enc), device=x.device).view(torch.int16).view(-1)
            assert torch.equal(dec, x.view(torch.int16)), "not lossless"
            t_enc = cuda_time(lambda: c.encode(data), repeats)
            t_dec = cuda_time(lambda: c.decode(enc), repeats)
            rows.append(row(label, x.numel() * 2, enc.buffer_size, t_enc, t_dec))
        except Exception as exc:
            rows.append(row(label, x.numel() * 2, None, None, None, f"failed: {type(exc).__name__}: {exc}"))
    return rows


SEED_AXES = ("layer", "kv", "token", "head", "channel")
SEED_CODECS = [  # (label, codec, calibration options or None: calibrated only where the codec needs it)
    ("splitzip", "splitzip", {}), ("splitzip, no codebook (calibrates per call)", "splitzip", None), ("entropy", "entropy", {"token_axis": 2}), ("tca-tbe", "tca-tbe", None),
    ("k8v4 (lossy)", "k8v4", None), ("k4v2 (lossy)", "k4v2", None),
    ("lowrank e=0.99 (lossy)", "lowrank", {"energy": 0.99}),
    ("lowrank e=0.99 +k8v4 (lossy)", "lowrank", {"energy": 0.99, "quantize": "k8v4"}),
]


def seed_blocks(chunk: int, block_tokens: int = 16) -> torch.Tensor:
    """Real KV of one chunk as blocks of every layer's K and V for ``block_tokens`` tokens:
    [block, layer, kv, token, head, channel] (a vLLM request's blocks, all layers in one)."""
    import numpy as np

    z = np.load(codec.bench.SAMPLE)
    kv = torch.stack([torch.stack([torch.from_numpy(z[f"c{chunk}_l{l}_{k}"].view(np.int16)).view(torch.bfloat16)
                                   for k in "kv"]) for l in range(30)])  # [layer, kv, head, token, channel]
    n = kv.shape[3] // block_tokens
    kv = kv[:, :, :, :n * block_tokens].reshape(*kv.shape[:3], n, block_tokens, kv.shape[4])
    return kv.permute(3, 0, 1, 4, 2, 5).contiguous()


def bench_seed_codecs(size: int, repeats: int) -> list[dict]:
    """The registered codecs on real KV blocks tiled to ``size`` bytes, all blocks in one call:
    GPU frames byte-compared with the CPU reference's on a sample of blocks, GPU decode
    compared with the CPU's (bit-exact to the input for lossless codecs), then timed."""
    calib, data = seed_blocks(0), seed_blocks(1)
    layout = codec.BlockLayout(tuple(data.shape[1:]), SEED_AXES)
    count = max(1, size // (data[0].numel() * 2))
    x = data.repeat((count + data.shape[0] - 1) // data.shape[0], 1, 1, 1, 1, 1)[:count].cuda()
    ids = torch.arange(count, device="cuda")
    sample = torch.arange(min(4, count))
    raw = x.numel() * 2
    t_copy = cuda_time(lambda: x.clone(), repeats)
    rows = [row(f"device copy (roofline), {raw >> 20} MiB", raw, None, t_copy, t_copy, "bytes moved = 2x")]
    for label, name, options in SEED_CODECS:
        if name not in codec.names():
            rows.append(row(label, raw, None, None, None, "not registered"))
            continue
        c = codec.get(name)
        # entropy's contexts are the positions of one block off its token axis: it takes blocks one by one
        samples = list(calib) if name == "entropy" else calib
        book = c.calibrate(samples, axes=("block", *SEED_AXES), **options) if options is not None else None
        bound = c.bind(book, layout)
        frame = c.encode_blocks(x, ids, bound)
        out = torch.zeros_like(x)
        c.decode_blocks(frame, out, ids, bound)
        cpu_frame = c.encode_blocks(x[:len(sample)].cpu(), sample, bound)
        gpu_frame = c.encode_blocks(x[:len(sample)], sample.cuda(), bound).cpu()
        cpu_out = torch.zeros_like(x[:len(sample)].cpu())
        c.decode_blocks(cpu_frame, cpu_out, sample, bound)
        same_bytes = torch.equal(cpu_frame, gpu_frame)
        same_values = torch.equal(cpu_out.view(torch.int16), out[:len(sample)].cpu().view(torch.int16))
        exact = torch.equal(out.view(torch.int16), x.view(torch.int16))
        assert same_bytes and same_values, f"{label}: GPU and CPU differ (frame {same_bytes}, values {same_values})"
        assert exact or not c.lossless, f"{label}: lossless codec not bit-exact on the GPU"
        t_enc = cuda_time(lambda: c.encode_blocks(x, ids, bound), repeats)
        t_dec = cuda_time(lambda: c.decode_blocks(frame, out, ids, bound), repeats)
        err = "" if c.lossless else f"; max |err| {float((out.float() - x.float()).abs().max()):.3g}"
        rows.append(row(label, raw, frame.numel(), t_enc, t_dec,
                        f"GPU == CPU on {len(sample)} blocks; {'bit-exact' if exact else 'lossy'}{err}"))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", default="256M")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="print a kernel-level profile of encode/decode")
    parser.add_argument("--host-profile", action="store_true", help="profile the host side of 64 MiB block calls, then stop")
    parser.add_argument("--sweep", action="store_true", help="time the kernel variants in SWEEP, then stop")
    parser.add_argument("--skip-cpu-check", action="store_true", help="skip the full-size CPU byte comparison")
    parser.add_argument("--seed-codecs", metavar="BYTES",
                        help="only the registered codecs on real KV blocks of all layers, this much (e.g. 1G)")
    args = parser.parse_args()
    n = parse_size(args.elements)
    device = torch.device("cuda")
    calib, data, source = kv_source()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "elements": n, "source": source, "command": " ".join(sys.argv)}
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except ImportError:
        pass
    print(json.dumps(env))
    if args.seed_codecs:
        report(bench_seed_codecs(parse_size(args.seed_codecs), args.repeats), env, args.json)
        return
    book = codec.calibrate([calib.to(torch.bfloat16)])
    x = tile(data, n).to(torch.bfloat16).to(device)
    rows = []
    if args.host_profile:
        host_profile(x, book)
        return
    if args.sweep:
        sweep(x, book, args.repeats)
        return
    if args.profile:
        profile_calls(x, book)
        host_timeline(x, book)

    t_copy = cuda_time(lambda: x.clone(), args.repeats)
    rows.append(row("device copy (roofline)", x.numel() * 2, None, t_copy, t_copy, "GB/s of input; bytes moved = 2x"))
    sz = bench_splitzip(x, book, args.repeats, "splitzip bf16")
    if not args.skip_cpu_check:
        started = time.perf_counter()
        cpu_frame = codec.encode(x.cpu(), book)
        same = torch.equal(cpu_frame, codec.encode(x, book).cpu())
        sz["note"] = f"GPU frame == CPU frame: {same} (CPU encode {time.perf_counter() - started:.1f} s)"
        assert same, "GPU and CPU frames differ"
    rows.append(sz)
    rows.append(bench_kernels_only(x, book))
    rows.append(bench_blocks(x, book, args.repeats))
    buf = torch.empty(codec.frame_capacity(x.shape, x.dtype), dtype=torch.uint8, device=device)
    t_into = cuda_time(lambda: codec.encode_into(x, book, buf), args.repeats)
    rows.append(row("splitzip bf16 encode_into (no host sync)", x.numel() * 2, None, t_into, None))
    small = x[: 1 << 21]  # a 4 MiB pipeline chunk: per-call overhead shows here
    small_frame = codec.encode(small, book)
    small_out = torch.empty_like(small)
    rows.append(row("splitzip bf16, 4 MiB calls", small.numel() * 2, small_frame.numel(),
                    cuda_time(lambda: codec.encode(small, book), args.repeats),
                    cuda_time(lambda: codec.decode(small_frame, out=small_out), args.repeats)))
    small_buf = torch.empty(codec.frame_capacity(small.shape, small.dtype), dtype=torch.uint8, device=device)

    def queued() -> None:
        for _ in range(16):
            codec.encode_into(small, book, small_buf)
    rows.append(row("splitzip bf16, 16 x 4 MiB encode_into queued", 16 * small.numel() * 2, None,
                    cuda_time(queued, args.repeats), None))
    sub = x[: min(n, 1 << 26)]
    t_ref_enc = cuda_time(lambda: _encode(sub, book, checksum=False, chunk=1024, force=None), 3, 1)
    ref_frame = _encode(sub, book, checksum=False, chunk=1024, force=None)
    t_ref_dec = cuda_time(lambda: codec.frames._decode_validated(ref_frame, codec.read_header(ref_frame)), 3, 1)
    rows.append(row("torch reference on GPU (unfused)", sub.numel() * 2, ref_frame.numel(), t_ref_enc, t_ref_dec,
                    f"{sub.numel()} elements"))
    for dtype in (torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        b = codec.calibrate([calib.to(dtype)])
        rows.append(bench_splitzip(x.to(dtype), b, args.repeats, f"splitzip {codec.layout_for(dtype).name}"))
    rows.extend(bench_nvcomp(x, args.repeats))
    report(rows, env, args.json)


def report(rows: list[dict], env: dict, path: Path | None) -> None:
    print(f"\n{'codec':<44}{'ratio':>8}{'enc GB/s':>11}{'dec GB/s':>11}  note")
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{r['codec']:<44}{fmt(r['ratio'], '.3f'):>8}{fmt(r['encode_gbps'], '.1f'):>11}"
              f"{fmt(r['decode_gbps'], '.1f'):>11}  {r['note']}")
    if path:
        path.write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
