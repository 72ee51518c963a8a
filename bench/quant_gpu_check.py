"""k8v4 / k4v2 on a GPU, one device call: bit-exactness against the CPU reference, then timings.

    python bench/quant_gpu_check.py [--gib 1.0] [--check-mib 16] [--repeats 20] [--json results.json]

Data: the real SmolLM2 KV sample (K and V of all 30 layers, [layers, kv, heads, tokens, 64]
bf16) tiled along the layer axis to about ``--gib`` GiB. Bit-exactness: the GPU frame's streams
for the first and last ``--check-mib`` MiB of layers equal the CPU reference's frame of those slices, byte for
byte, and the GPU reconstruction of the whole frame equals the reference's there. GB/s counts
BF16 input bytes (for the copy roofline too: a copy moves twice that). Times are medians of CUDA
events: ``kernel`` rows are the two Triton launches alone (into preallocated buffers), ``codec``
rows the public call (host syncs, header, and the host CRC when ``crc``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.codec.quant import K4V2, K8V4, QuantLayout, codec as qcodec, gpu  # noqa: E402
from kvferry.codec.quant.format import QuantHeader, Stream  # noqa: E402

SAMPLE = ROOT / "kvferry" / "data" / "kv_smollm2_gpl3.npz"
CONFIGS = [(2048, 4), (4096, 4), (8192, 8), (16384, 8)]  # (elements per program, warps)
LAYOUT = QuantLayout(1, 4)


def real_kv() -> torch.Tensor:
    z = np.load(SAMPLE)
    kinds = [torch.stack([torch.from_numpy(z[f"c1_l{l}_{k}"].view(np.int16)) for l in range(30)]) for k in "kv"]
    return torch.stack(kinds, 1).view(torch.bfloat16)  # [30, 2, 3, 511, 64]


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def stream_slices(header: QuantHeader, first: int, count: int) -> list[tuple[int, int]]:
    """Byte ranges of vectors [first, first + count) of each kind in each stream."""
    c, n = header.channels, header.vectors
    out = []
    for kind in (0, 1):
        per = c * header.bits[kind] // 8
        out.append((header.offsets[kind] + first * per, header.offsets[kind] + (first + count) * per))
    p = header.offsets[Stream.PARAMS]
    out += [(p + 4 * (kind * n + first), p + 4 * (kind * n + first + count)) for kind in (0, 1)]
    return out


def check_exact(x: torch.Tensor, frame: torch.Tensor, y: torch.Tensor, c, slab: int) -> float:
    """GPU frame and reconstruction against the CPU reference on the first and last ``slab``
    layers; returns the reference encoder's seconds per layer."""
    header = qcodec.read_header(frame)
    per_layer = header.vectors // x.shape[0]
    seconds = 0.0
    for start in (0, x.shape[0] - slab):
        part = x[start:start + slab].cpu()
        t0 = time.perf_counter()
        ref = qcodec.encode(part, LAYOUT, c.frame_id, checksum=False)
        seconds += time.perf_counter() - t0
        ref_header = qcodec.read_header(ref)
        for (a, b), (ra, rb) in zip(stream_slices(header, start * per_layer, slab * per_layer),
                                    stream_slices(ref_header, 0, slab * per_layer)):
            assert torch.equal(frame[a:b].cpu(), ref[ra:rb]), f"{c.name}: GPU bytes differ at layer {start}"
        assert torch.equal(y[start:start + slab].cpu().view(torch.int16), qcodec.decode(ref).view(torch.int16)), \
            f"{c.name}: GPU values differ at layer {start}"
    return seconds / (2 * slab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--check-mib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import triton

    base = real_kv()
    reps = max(1, round(args.gib * 2**30 / (base.numel() * 2)))
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "rows": []}
    print(f"{results['device']}  torch {torch.__version__}  triton {triton.__version__}")

    def row(name: str, seconds: float, nbytes: int, **extra) -> None:
        r = {"name": name, "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9, **extra}
        results["rows"].append(r)
        print(f"{name:<44} {r['ms']:9.3f} ms {r['GB/s']:9.1f} GB/s" + "".join(f"  {k}={v}" for k, v in extra.items()))

    for dtype in (torch.bfloat16, torch.float16):
        x = base.to(dtype).repeat(reps, 1, 1, 1, 1).cuda()
        nbytes = x.numel() * 2
        name = str(dtype).removeprefix("torch.")
        print(f"\n{name} input {list(x.shape)} = {nbytes / 2**30:.2f} GiB")
        out = torch.empty_like(x)
        row(f"copy roofline {name}", cuda_time(lambda: out.copy_(x), args.repeats), nbytes)
        slab = max(1, int(args.check_mib * 2**20) // (base[0].numel() * 2))
        for c in (K8V4, K4V2):
            frame = qcodec.encode(x, LAYOUT, c.frame_id, checksum=True)
            header = qcodec.read_header(frame)
            y = c.decode(frame)
            per_layer = check_exact(x, frame, y, c, slab)
            ratio = nbytes / frame.numel()
            print(f"{c.name}: bit-exact against the CPU reference (first and last {slab} layers), ratio {ratio:.3f}")
            row(f"{c.name} {name} reference encode (CPU)", per_layer, nbytes // x.shape[0], ratio=round(ratio, 3))
            buf = torch.empty_like(frame)
            for tile, warps in CONFIGS:
                enc = cuda_time(lambda: gpu.encode_into(x, buf, header, tile=tile, num_warps=warps), args.repeats)
                dec = cuda_time(lambda: gpu.decode_into(frame, out, header, tile=tile, num_warps=warps), args.repeats)
                assert torch.equal(buf[header.offsets[0]:], frame[header.offsets[0]:]) and torch.equal(out, y)
                row(f"{c.name} {name} encode kernel t{tile} w{warps}", enc, nbytes)
                row(f"{c.name} {name} decode kernel t{tile} w{warps}", dec, nbytes)
            row(f"{c.name} {name} encode codec, no crc",
                cuda_time(lambda: qcodec.encode(x, LAYOUT, c.frame_id, checksum=False), args.repeats), nbytes)
            row(f"{c.name} {name} encode codec, crc", cuda_time(lambda: c.encode(x, LAYOUT), args.repeats), nbytes)
            row(f"{c.name} {name} decode codec, crc", cuda_time(lambda: c.decode(frame, out=out), args.repeats),
                nbytes)
            ids = torch.randperm(x.shape[0], device="cuda")[: x.shape[0] // 2]
            bound = QuantLayout(0, 3)
            bframe = c.encode_blocks(x, ids, bound)
            check_exact(x[ids], bframe, c.decode(bframe), c, 2)
            row(f"{c.name} {name} encode_blocks (half the blocks)",
                cuda_time(lambda: qcodec.encode_blocks(x, ids, bound, c.frame_id, checksum=False), args.repeats),
                nbytes // 2)
            row(f"{c.name} {name} decode_blocks (half the blocks)",
                cuda_time(lambda: c.decode_blocks(bframe, out, ids, bound), args.repeats), nbytes // 2)
            assert torch.equal(out[ids].view(torch.int16), c.decode(bframe).view(torch.int16))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
