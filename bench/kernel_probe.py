"""Kernel-level view of the GPU codec's dense passes, against copy kernels that move the same
bytes: where the whole-call numbers of codec_gpu.py lose time to the kernels themselves.

    python bench/kernel_probe.py [--elements 256M] [--variants '{"CHUNKS_PER_WARP": 4}' ...]
    python bench/kernel_probe.py --once        # each kernel once, for ncu

Rows: torch's clone; `copy16`, a copy with 16-byte accesses; `like_decode` and `like_encode`,
kernels with the dense passes' exact traffic (8 + 4 bytes read and 16 written per 8 elements,
or the reverse) and no work; then the codec's own kernels per TUNING variant, timed by the
torch profiler (CUPTI) over repeated encode and decode calls. GB/s counts uncompressed bytes;
TB/s counts bytes moved (read + written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry import codec  # noqa: E402
from kvferry.codec.splitzip import gpu as splitzip_gpu  # noqa: E402
from bench.codec_bench import kv_source, parse_size, tile  # noqa: E402
from codec_gpu import cuda_time, kernel_times  # noqa: E402  (bench/, this script's directory)

TRAFFIC = r"""
typedef unsigned long long u64;
#define UNROLL 4
extern "C" __global__ void copy16(const uint4* __restrict__ in, uint4* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; k++) if (i + k * blockDim.x < n) v[k] = in[i + k * blockDim.x];
#pragma unroll
    for (int k = 0; k < UNROLL; k++) if (i + k * blockDim.x < n) out[i + k * blockDim.x] = v[k];
}
// Per group of 8 bf16 elements: 8 residual bytes and 4 code bytes in, 16 bytes out.
extern "C" __global__ void like_decode(const u64* __restrict__ res, const unsigned* __restrict__ codes,
                                       uint4* __restrict__ out, u64 groups) {
    const u64 g = (u64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    u64 r[UNROLL];
    unsigned c[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; k++) if (g + k * blockDim.x < groups) { r[k] = res[g + k * blockDim.x]; c[k] = codes[g + k * blockDim.x]; }
#pragma unroll
    for (int k = 0; k < UNROLL; k++)
        if (g + k * blockDim.x < groups) out[g + k * blockDim.x] = make_uint4((unsigned)r[k], (unsigned)(r[k] >> 32), c[k], c[k] ^ (unsigned)r[k]);
}
extern "C" __global__ void like_encode(const uint4* __restrict__ in, u64* __restrict__ res, unsigned* __restrict__ codes,
                                       u64 groups) {
    const u64 g = (u64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; k++) if (g + k * blockDim.x < groups) v[k] = in[g + k * blockDim.x];
#pragma unroll
    for (int k = 0; k < UNROLL; k++)
        if (g + k * blockDim.x < groups) {
            res[g + k * blockDim.x] = (u64)v[k].x | ((u64)v[k].y << 32);
            codes[g + k * blockDim.x] = v[k].z ^ v[k].w;
        }
}
"""
THREADS, UNROLL = 256, 4


def traffic_kernels(groups: int):
    """Launchers of the traffic kernels over `groups` groups of 8 bf16 elements."""
    import cupy

    module = cupy.RawModule(code=TRAFFIC, options=("-std=c++17",))
    dev = torch.device("cuda")
    src = torch.empty(groups * 16, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    res = torch.empty(groups * 8, dtype=torch.uint8, device=dev).random_()
    codes = torch.empty(groups * 4, dtype=torch.uint8, device=dev).random_()
    grid = (-(-groups // (THREADS * UNROLL)),)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def launch(name, *args):
        kernel = module.get_function(name)
        return lambda: kernel(grid, (THREADS,), args, stream=stream)

    return {
        "copy16": launch("copy16", src.data_ptr(), dst.data_ptr(), cupy.uint64(groups)),
        "like_decode": launch("like_decode", res.data_ptr(), codes.data_ptr(), dst.data_ptr(), cupy.uint64(groups)),
        "like_encode": launch("like_encode", src.data_ptr(), res.data_ptr(), codes.data_ptr(), cupy.uint64(groups)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", default="256M")
    parser.add_argument("--variants", nargs="*", default=[], help="TUNING overrides as JSON objects")
    parser.add_argument("--once", action="store_true", help="run each kernel once (for ncu) and stop")
    args = parser.parse_args()
    n = parse_size(args.elements)
    calib, data, _ = kv_source()
    book = codec.calibrate([calib.to(torch.bfloat16)])
    x = tile(data, n).to(torch.bfloat16).cuda()
    raw = n * 2
    frame = codec.encode(x, book)
    out = torch.empty_like(x)
    moved = raw + frame.numel()  # either pass reads one side and writes the other
    traffic = traffic_kernels(n // 8)
    if args.once:
        x.clone()
        for launch in traffic.values():
            launch()
        codec.encode(x, book)
        codec.decode(frame, out=out)
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, {n >> 20}M bf16 elements, frame {frame.numel()} bytes")
    print(f"{'kernel':<44}{'µs':>9}{'GB/s':>9}{'TB/s moved':>12}")
    t = cuda_time(lambda: x.clone(), 20)
    print(f"{'torch clone':<44}{t * 1e6:>9.1f}{raw / t / 1e9:>9.0f}{2 * raw / t / 1e12:>12.2f}")
    for name, launch in traffic.items():
        t = cuda_time(launch, 20)
        bytes_moved = 2 * raw if name == "copy16" else raw * 7 // 4
        print(f"{name:<44}{t * 1e6:>9.1f}{raw / t / 1e9:>9.0f}{bytes_moved / t / 1e12:>12.2f}")
    default = dict(splitzip_gpu.TUNING)
    variants = [{}] + [json.loads(v) for v in args.variants]
    try:
        for variant in variants:
            splitzip_gpu.TUNING = {**default, **variant}
            same = torch.equal(codec.encode(x, book), frame)
            out.zero_()
            codec.decode(frame, out=out)
            same = same and torch.equal(out.view(torch.int16), x.view(torch.int16))
            label = json.dumps(variant) if variant else "default"
            print(f"--- {label}: frames and output identical to the default's: {same}")
            for call, fn in (("encode", lambda: codec.encode(x, book)), ("decode", lambda: codec.decode(frame, out=out))):
                for name, us in sorted(kernel_times(fn).items(), key=lambda kv: -kv[1]):
                    print(f"{call + ' ' + name:<44}{us:>9.1f}{raw / us / 1e3:>9.0f}{moved / us / 1e6:>12.2f}")
                whole = cuda_time(fn, 20)
                print(f"{call + ' whole call':<44}{whole * 1e6:>9.1f}{raw / whole / 1e9:>9.0f}")
    finally:
        splitzip_gpu.TUNING = default


if __name__ == "__main__":
    main()
