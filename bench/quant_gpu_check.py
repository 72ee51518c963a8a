"""k8v4 / k4v2 on a GPU: bit-exactness against the CPU reference, then timings.

    python bench/quant_gpu_check.py [--gib 1.0] [--check-mib 16] [--repeats 20] [--json results.json]
    python bench/quant_gpu_check.py --blocks [--gib 1.0] [--repeats 20] [--json results.json]

``--blocks``: the engine's path, ``encode_blocks``/``decode_blocks`` of the registry entries
(no stream CRC) on every block of a cache in two layouts: all layers of 16 tokens per block
(``[block, layer=30, kv, token=16, head=3, channel=64]``, the real sample as ``bench/codec_gpu.py
--seed-codecs`` lays it out) and a vLLM-like per-layer region (``[block, kv, token=16, head=8,
channel=128]``, random bf16). GPU frames and reconstructions equal the CPU reference's on the
first and last 4 blocks, byte for byte; ``kernel`` rows time the kernels alone for several
(elements per program, warps); where ``kvferry/codec/quant/_before_codec.py`` exists (an
untracked copy of the previous implementation), its calls are timed beside, and its whole frames
and reconstructions must equal the new ones.

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

SAMPLE = ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz"
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


BLOCK_CONFIGS = [(2048, 4), (4096, 4), (8192, 8), (16384, 8)]


def block_layouts(gib: float) -> list[tuple[str, torch.Tensor, QuantLayout]]:
    """(name, cache on the GPU, bound layout) of the two block layouts, about ``gib`` GiB each."""
    sys.path.insert(0, str(ROOT / "bench"))
    from codec_gpu import seed_blocks

    data = seed_blocks(1)  # [block, layer, kv, token, head, channel]
    count = max(1, round(gib * 2**30 / (data[0].numel() * 2)))
    seed = data.repeat((count + data.shape[0] - 1) // data.shape[0], 1, 1, 1, 1, 1)[:count].cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    per_layer = (2, 16, 8, 128)
    n = max(1, round(gib * 2**30 / (2 * 16 * 8 * 128 * 2)))
    vllm = (torch.randn((n, *per_layer), generator=g, device="cuda") * 2).to(torch.bfloat16)
    return [("all-layer [b,30,2,16,3,64]", seed, QuantLayout(1, 4)),
            ("per-layer [b,2,16,8,128]", vllm, QuantLayout(0, 3))]


def blocks_main(args, results: dict, row) -> None:
    try:
        from kvferry.codec.quant import _before_codec as before
    except ImportError:
        before = None
    for lname, x, bound in block_layouts(args.gib):
        try:
            one_layout(args, row, before, lname, x, bound)
        except Exception:  # report, and go on with the next layout
            import traceback
            traceback.print_exc()
        del x
        torch.cuda.empty_cache()
    whole_tensor(args, row, before)


def one_layout(args, row, before, lname: str, x: torch.Tensor, bound: QuantLayout) -> None:
    from kvferry import codec

    nbytes = x.numel() * 2
    ids = torch.arange(x.shape[0], device="cuda")
    print(f"\n{lname}: {x.shape[0]} blocks, {nbytes / 2**30:.2f} GiB")
    out = torch.empty_like(x)
    row(f"{lname} copy roofline", cuda_time(lambda: out.copy_(x), args.repeats), nbytes)
    for name in ("k8v4", "k4v2"):
        c = codec.get(name)
        frame = c.encode_blocks(x, ids, bound)
        header = qcodec.read_header(frame)
        out.zero_()
        c.decode_blocks(frame, out, ids, bound)
        vb = header.vectors // x.shape[0]
        k = min(4, x.shape[0])
        for first in sorted({0, x.shape[0] - k}):
            part = x[first:first + k].cpu()
            ref = qcodec.encode_blocks(part, torch.arange(k), bound, c.frame_id, checksum=False)
            ref_header = qcodec.read_header(ref)
            for (a, b), (ra, rb) in zip(stream_slices(header, first * vb, k * vb),
                                        stream_slices(ref_header, 0, k * vb)):
                assert torch.equal(frame[a:b].cpu(), ref[ra:rb]), f"{name} {lname}: bytes differ at block {first}"
            want = torch.zeros_like(part)
            qcodec.decode_blocks(ref, want, torch.arange(k), bound)
            assert torch.equal(out[first:first + k].cpu().view(torch.int16), want.view(torch.int16)), \
                f"{name} {lname}: values differ at block {first}"
        note = "== CPU reference (first/last 4 blocks)"
        if before is not None:
            old_bound = before.QuantLayout(bound.kv_axis, bound.channel_axis)
            old = before.encode_blocks(x, ids, old_bound, c.frame_id, checksum=False)
            assert torch.equal(old, frame), f"{name} {lname}: frame differs from the previous implementation"
            old_out = torch.zeros_like(x)
            before.decode_blocks(frame, old_out, ids, old_bound)
            assert torch.equal(old_out.view(torch.int16), out.view(torch.int16)), f"{name} {lname}: values differ"
            del old_out
            note += "; == previous code (whole frame and cache)"
        print(f"{name}: {note}, ratio {nbytes / frame.numel():.3f}")
        defaults = gpu.ENCODE_TILE, gpu.ENCODE_WARPS, gpu.DECODE_TILE, gpu.DECODE_WARPS
        for tile, warps in BLOCK_CONFIGS:  # the public calls with each configuration as the default
            gpu.ENCODE_TILE, gpu.ENCODE_WARPS, gpu.DECODE_TILE, gpu.DECODE_WARPS = tile, warps, tile, warps
            row(f"{lname} {name} encode_blocks t{tile} w{warps}",
                cuda_time(lambda: c.encode_blocks(x, ids, bound), args.repeats), nbytes)
            row(f"{lname} {name} decode_blocks t{tile} w{warps}",
                cuda_time(lambda: c.decode_blocks(frame, out, ids, bound), args.repeats), nbytes)
        gpu.ENCODE_TILE, gpu.ENCODE_WARPS, gpu.DECODE_TILE, gpu.DECODE_WARPS = defaults
        assert torch.equal(c.encode_blocks(x, ids, bound), frame)
        c.decode_blocks(frame, out, ids, bound)
        assert torch.equal(out[x.shape[0] - k:].cpu().view(torch.int16), want.view(torch.int16))
        if before is not None:
            row(f"{lname} {name} encode_blocks BEFORE", cuda_time(
                lambda: before.encode_blocks(x, ids, old_bound, c.frame_id, checksum=False), args.repeats), nbytes)
            row(f"{lname} {name} decode_blocks BEFORE", cuda_time(
                lambda: before.decode_blocks(frame, out, ids, old_bound), args.repeats), nbytes)
        buf = torch.empty_like(frame)
        for tile, warps in BLOCK_CONFIGS:
            enc = cuda_time(lambda: gpu.encode_into(x, buf, header, ids, tile=tile, num_warps=warps), args.repeats)
            dec = cuda_time(lambda: gpu.decode_into(frame, out, header, ids, tile=tile, num_warps=warps),
                            args.repeats)
            assert torch.equal(buf[header.offsets[0]:], frame[header.offsets[0]:])
            row(f"{lname} {name} encode kernel t{tile} w{warps}", enc, nbytes)
            row(f"{lname} {name} decode kernel t{tile} w{warps}", dec, nbytes)
        flag = gpu.check_frame(frame, header, ids, x.shape[0])
        row(f"{lname} {name} check_frame kernel", cuda_time(lambda: gpu.check_frame(frame, header, ids, x.shape[0]),
                                                            args.repeats), nbytes)
        assert int(flag.item()) == 0


def whole_tensor(args, row, before) -> None:
    """The whole-tensor path (encode/decode): new kernels against the previous ones."""
    x = real_kv().repeat(max(1, round(args.gib * 2**30 / (real_kv().numel() * 2))), 1, 1, 1, 1).cuda()
    nbytes = x.numel() * 2
    out = torch.empty_like(x)
    print(f"\nwhole tensor {list(x.shape)}")
    for c in (K8V4, K4V2):
        frame = c.encode(x, LAYOUT)
        header = qcodec.read_header(frame)
        buf = torch.empty_like(frame)
        for tile, warps in CONFIGS[:2]:
            row(f"tensor {c.name} encode kernel t{tile} w{warps}",
                cuda_time(lambda: gpu.encode_into(x, buf, header, tile=tile, num_warps=warps), args.repeats), nbytes)
            assert torch.equal(buf[header.offsets[0]:], frame[header.offsets[0]:])
            row(f"tensor {c.name} decode kernel t{tile} w{warps}",
                cuda_time(lambda: gpu.decode_into(frame, out, header, tile=tile, num_warps=warps), args.repeats),
                nbytes)
            assert torch.equal(out.view(torch.int16), c.decode(frame).view(torch.int16))
        if before is not None:
            from kvferry.codec.quant import _before_gpu as old_gpu
            for tile, warps in CONFIGS[:2]:
                row(f"tensor {c.name} encode kernel BEFORE t{tile} w{warps}",
                    cuda_time(lambda: old_gpu.encode_into(x, buf, header, tile=tile, num_warps=warps), args.repeats),
                    nbytes)
                row(f"tensor {c.name} decode kernel BEFORE t{tile} w{warps}",
                    cuda_time(lambda: old_gpu.decode_into(frame, out, header, tile=tile, num_warps=warps),
                              args.repeats), nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--check-mib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blocks", action="store_true", help="the engine's block path (see above)")
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
        print(f"{name:<58} {r['ms']:9.3f} ms {r['GB/s']:9.1f} GB/s" + "".join(f"  {k}={v}" for k, v in extra.items()))

    if args.blocks:
        blocks_main(args, results, row)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return

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
