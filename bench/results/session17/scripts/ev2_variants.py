"""Encode/decode kernel variants of entropy v2 (source substitutions), timed in one process:
median ms of the whole call and of the coder kernel (torch profiler), BF16 256M real KV."""
import functools, sys, statistics
import torch
sys.path.insert(0, '.'); sys.path.insert(0, 'bench')
from kvferry.codec import entropy
from kvferry.codec.entropy import gpu
from kvferry.codec.bench import tile
from entropy_gpu import real_kv
from pathlib import Path

SRC = gpu._SOURCE.read_text()
VARIANTS = {
    "base": [],
    "touch": [("prefetch_l2(sp + ((GROUP + lane - 1) << 5));", "touch(sp + ((GROUP + lane - 1) << 5));")],
    "far": [("prefetch_l2(sp + ((GROUP + lane - 1) << 5));", "prefetch_l2(sp + ((2 * GROUP + lane - 1) << 5));")],
    "touchfar": [("prefetch_l2(sp + ((GROUP + lane - 1) << 5));", "touch(sp + ((2 * GROUP + lane - 1) << 5));")],
}
TOUCH = '''
template <typename P> __device__ __forceinline__ void touch(const P* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
}
'''
kv = real_kv()
book = entropy.calibrate(kv["c0"].to(torch.bfloat16), token_axis=3)
x = tile(kv["c1"].reshape(-1), 256 << 20).to(torch.bfloat16).cuda()
ref = entropy.encode(x, book, checksum=False).clone()
out = torch.empty_like(x)

def timed(fn, n=15):
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def kernel_us(fn, name):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5): fn()
        torch.cuda.synchronize()
    ev = [e for e in p.key_averages() if name in e.key]
    return ev[0].device_time_total / ev[0].count if ev else float("nan")

for name in sys.argv[1:] or VARIANTS:
    if name.endswith(".cu"):
        path = Path(name)
    else:
        src = SRC.replace("// A streamed word", TOUCH + "// A streamed word")
        for a, b in VARIANTS[name]:
            assert a in src, (name, a)
            src = src.replace(a, b)
        path = Path(f"/tmp/ev2_{name}.cu"); path.write_text(src)
    gpu._SOURCE = path
    gpu._module.cache_clear(); gpu._kernel.cache_clear()
    f = entropy.encode(x, book, checksum=False)
    assert torch.equal(f, ref), name
    entropy.decode(f, out=out); assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    enc = timed(lambda: entropy.encode(x, book, checksum=False))
    dec = timed(lambda: entropy.decode(f, out=out))
    ke = kernel_us(lambda: entropy.encode(x, book, checksum=False), "entropy_encode")
    kd = kernel_us(lambda: entropy.decode(f, out=out), "entropy_decode")
    gb = x.numel() * 2 / 1e6
    print(f"{name:10s} encode {enc:.3f} ms ({gb / enc:.0f} GB/s) kernel {ke:.0f} us | decode {dec:.3f} ms ({gb / dec:.0f} GB/s) kernel {kd:.0f} us", flush=True)
