"""Entropy codec on one GPU: whole-call
GB/s of the public encode/decode (256M elements of real KV tiled, BF16 and E4M3) and of the
registry's block path (1 GiB of real KV blocks), each beside the GPU time of its kernels.
Every row first checks the GPU frame equal to the CPU reference's on a prefix and the GPU
round trip bit-exact on the whole tensor.

    python3 bench/entropy_profile.py [--elements 256M] [--blocks 1G] [--repeats 5] [--json out.json]

GB/s counts uncompressed bytes; times are medians of CUDA-event timings of the public call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry import codec  # noqa: E402
from kvferry.codec import entropy  # noqa: E402
from bench.codec_bench import parse_size, tile  # noqa: E402
from kvferry.codec.entropy.codec import encode_reference  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels(cg, fn) -> str:
    times = cg.kernel_times(fn, 5)
    total = sum(times.values())
    top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:4])
    return f"kernels {total:.0f} us ({top})"


def whole_tensor(cg, kv: dict, n: int, repeats: int, check: int) -> list[dict]:
    rows = []
    data = kv["c1"].reshape(-1)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        book = entropy.calibrate(kv["c0"].to(dtype), token_axis=3)
        x = tile(data, n).to(dtype).cuda()
        m = min(n, check)
        assert torch.equal(entropy.encode(x[:m], book).cpu(), encode_reference(x[:m].cpu(), book)), "GPU != CPU"
        frame = entropy.encode(x, book, checksum=False)
        out = torch.empty_like(x)
        entropy.decode(frame, out=out)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), "round trip not bit-exact"
        raw = x.numel() * x.element_size()
        t_enc = cg.cuda_time(lambda: entropy.encode(x, book, checksum=False), repeats, 2)
        t_dec = cg.cuda_time(lambda: entropy.decode(frame, out=out), repeats, 2)
        note = (f"GPU==CPU on {m} elements; encode {_kernels(cg, lambda: entropy.encode(x, book, checksum=False))};"
                f" decode {_kernels(cg, lambda: entropy.decode(frame, out=out))}")
        rows.append(cg.row(f"entropy {str(dtype).removeprefix('torch.')} encode/decode(out=)", raw, frame.numel(),
                           t_enc, t_dec, note))
        print(json.dumps(rows[-1]), flush=True)
        if dtype == torch.bfloat16:
            t_copy = cg.cuda_time(lambda: x.clone(), repeats)
            rows.append(cg.row("device copy (roofline)", raw, None, t_copy, t_copy, "GB/s of input"))
            print(json.dumps(rows[-1]), flush=True)
        del x, frame, out
        torch.cuda.empty_cache()
    return rows


def host_profile(kv: dict, n: int, calls: int = 20, trace: Path | None = None) -> None:
    """Where the host's share of a whole call goes (cProfile of ``calls`` BF16 encodes and
    decodes): the GPU idles while the host works between a read and the next launch. With
    ``trace``, also a Chrome trace of three calls each (the GPU's idle gaps within a call)."""
    import cProfile
    import pstats

    book = entropy.calibrate(kv["c0"].to(torch.bfloat16), token_axis=3)
    x = tile(kv["c1"].reshape(-1), n).to(torch.bfloat16).cuda()
    frame = entropy.encode(x, book, checksum=False)
    out = torch.empty_like(x)
    for name, fn in (("encode", lambda: entropy.encode(x, book, checksum=False)),
                     ("decode", lambda: entropy.decode(frame, out=out))):
        fn()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        print(f"--- host profile, {calls} {name} calls (tottime s)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    if trace:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for name, fn in (("encode", lambda: entropy.encode(x, book, checksum=False)),
                             ("decode", lambda: entropy.decode(frame, out=out))):
                for _ in range(3):
                    torch.cuda.synchronize()
                    with record_function(f"call {name}"):
                        fn()
                        torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))


def blocks(cg, size: int, repeats: int) -> list[dict]:
    """The registry's block path, as ``codec_gpu.py --seed-codecs`` runs it."""
    rows = []
    calib, data = cg.seed_blocks(0), cg.seed_blocks(1)
    layout = codec.BlockLayout(tuple(data.shape[1:]), cg.SEED_AXES)
    c = codec.get("entropy")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        d = data.to(dtype)
        count = max(1, size // (d[0].numel() * 2))
        x = d.repeat((count + d.shape[0] - 1) // d.shape[0], 1, 1, 1, 1, 1)[:count].cuda()
        ids = torch.randperm(count, device="cuda")
        book = c.calibrate(list(calib.to(dtype)), axes=("block", *cg.SEED_AXES), token_axis=2)
        bound = c.bind(book, layout)
        frame = c.encode_blocks(x, ids, bound)
        out = torch.zeros_like(x)
        c.decode_blocks(frame, out, ids, bound)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), "block round trip not bit-exact"
        sample = ids[:4].cpu()
        assert torch.equal(c.encode_blocks(x.cpu(), sample, bound), c.encode_blocks(x, sample.cuda(), bound).cpu())
        raw = x.numel() * x.element_size()
        t_enc = cg.cuda_time(lambda: c.encode_blocks(x, ids, bound), repeats, 2)
        t_dec = cg.cuda_time(lambda: c.decode_blocks(frame, out, ids, bound), repeats, 2)
        note = (f"GPU==CPU on 4 blocks; encode {_kernels(cg, lambda: c.encode_blocks(x, ids, bound))}; "
                f"decode {_kernels(cg, lambda: c.decode_blocks(frame, out, ids, bound))}")
        rows.append(cg.row(f"entropy {str(dtype).removeprefix('torch.')} blocks ({count} x {d[0].numel()})", raw,
                           frame.numel(), t_enc, t_dec, note))
        print(json.dumps(rows[-1]), flush=True)
        del x, frame, out
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", default="256M")
    parser.add_argument("--blocks", default="1G", help="bytes of KV blocks for the block path (0: skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-elements", default="4M", help="prefix compared byte for byte with the CPU")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--host-profile", action="store_true", help="also print where the host's time goes")
    parser.add_argument("--trace", type=Path, help="with --host-profile: a Chrome trace of a few calls")
    args = parser.parse_args()
    cg, eg = _load("codec_gpu"), _load("entropy_gpu")
    env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "command": " ".join(sys.argv)}
    print(json.dumps(env), flush=True)
    rows = whole_tensor(cg, eg.real_kv(), parse_size(args.elements), args.repeats, parse_size(args.check_elements))
    if parse_size(args.blocks):
        rows += blocks(cg, parse_size(args.blocks), args.repeats)
    eg.print_table(rows, width=48)
    if args.host_profile:
        host_profile(eg.real_kv(), parse_size(args.elements), trace=args.trace)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
