"""Block-copy kernel variants on the GPU: time and exactness (the committed kernel is v0)."""
import statistics, sys, time
sys.path.insert(0, ".")
import cupy, torch
from kvferry.codec import blockcopy

V2 = r"""
template <int PER>
__device__ void piece(const int4* __restrict__ from, int4* __restrict__ to, long long start, long long vecs) {
    int4 v[PER];
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
        long long i = start + (long long)k * blockDim.x + threadIdx.x;
        if (i < vecs) v[k] = from[i];
    }
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
        long long i = start + (long long)k * blockDim.x + threadIdx.x;
        if (i < vecs) to[i] = v[k];
    }
}
extern "C" __global__ void copy4(const int4* __restrict__ src, int4* __restrict__ dst, const long long* __restrict__ src_ids,
                                 const long long* __restrict__ dst_ids, long long blocks, long long vecs) {
    for (long long b = blockIdx.y; b < blocks; b += gridDim.y)
        piece<4>(src + src_ids[b] * vecs, dst + dst_ids[b] * vecs, (long long)blockIdx.x * 4 * blockDim.x, vecs);
}
extern "C" __global__ void copy8(const int4* __restrict__ src, int4* __restrict__ dst, const long long* __restrict__ src_ids,
                                 const long long* __restrict__ dst_ids, long long blocks, long long vecs) {
    for (long long b = blockIdx.y; b < blocks; b += gridDim.y)
        piece<8>(src + src_ids[b] * vecs, dst + dst_ids[b] * vecs, (long long)blockIdx.x * 8 * blockDim.x, vecs);
}
"""
mod = cupy.RawModule(code=V2, options=("-std=c++17",))
k4, k8 = mod.get_function("copy4"), mod.get_function("copy8")

def launch(kernel, per, threads, src, si, dst, di, ybound=65535):
    vecs = src[0].nbytes // 16
    n = si.numel()
    grid = (-(-vecs // (per * threads)), min(n, ybound))
    kernel(grid, (threads,), (src.data_ptr(), dst.data_ptr(), si.data_ptr(), di.data_ptr(), cupy.int64(n), cupy.int64(vecs)),
           stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))

def timeit(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        xs.append(a.elapsed_time(b) / 1e3)
    return statistics.median(xs)

print(torch.cuda.get_device_name())
for blocks, block_shape in ((16384, (16, 8, 128)), (32768, (16, 8, 128)), (64, (16, 8, 128)), (1, (64, 16, 8, 128)), (256, (64, 16, 8, 128))):
    total = 2 * blocks + 16
    src = torch.randint(-32768, 32767, (total, *block_shape), dtype=torch.int16, device="cuda").view(torch.bfloat16)
    dst = torch.zeros_like(src)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(total, generator=g)
    si, di = order[:blocks].cuda(), order[blocks:2 * blocks].cuda()
    nbytes = blocks * src[0].nbytes
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); flat_b = torch.empty_like(flat_a)
    rows = {"memcpy D2D (roofline)": timeit(lambda: flat_b.copy_(flat_a))}
    rows["v0 committed"] = timeit(lambda: blockcopy.copy_blocks(src, si, dst, di))
    for name, kern, per in (("copy4 x256", k4, 4), ("copy8 x256", k8, 8)):
        dst.zero_()
        launch(kern, per, 256, src, si, dst, di); torch.cuda.synchronize()
        ok = torch.equal(dst.view(torch.int16)[di], src.view(torch.int16)[si])
        rows[name + ("" if ok else " WRONG")] = timeit(lambda: launch(kern, per, 256, src, si, dst, di))
    for name, kern, per in (("copy4 x512", k4, 4), ("copy4 x128", k4, 4)):
        th = int(name[-3:])
        rows[name] = timeit(lambda: launch(kern, per, th, src, si, dst, di))
    rows["torch index_select+index_copy_"] = timeit(lambda: dst.index_copy_(0, di, src.index_select(0, si)))
    print(f"\n{blocks} blocks of {src[0].nbytes >> 10} KiB ({nbytes / 2**20:.0f} MiB)")
    for k, v in rows.items():
        print(f"  {k:34s} {v * 1e6:9.1f} us  {nbytes / v / 1e9:7.0f} GB/s (of data moved)")
