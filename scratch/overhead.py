import sys, time, cProfile, pstats, torch
sys.path.insert(0, '.')
import codec
x = torch.randn(1 << 21).to(torch.bfloat16).cuda()
book = codec.calibrate(x)
buf = torch.empty(codec.frame_capacity(x.shape, x.dtype), dtype=torch.uint8, device='cuda')
frame = codec.encode(x, book); out = torch.empty_like(x)
for _ in range(20): codec.encode_into(x, book, buf); codec.decode(frame, out=out)
torch.cuda.synchronize()
for name, fn in [("encode_into", lambda: codec.encode_into(x, book, buf)), ("encode", lambda: codec.encode(x, book)), ("decode", lambda: codec.decode(frame, out=out))]:
    t = time.perf_counter()
    for _ in range(200): fn()
    torch.cuda.synchronize()
    print(name, "per call us", (time.perf_counter() - t) / 200 * 1e6, flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(200): codec.encode_into(x, book, buf); codec.decode(frame, out=out)
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats('tottime').print_stats(25)
import cupy
k = cupy.RawKernel(r'extern "C" __global__ void noop(unsigned long long a, unsigned long long b) {}', 'noop')
import numpy as np
k((1,), (32,), (np.uint64(1), np.uint64(2)))
t = time.perf_counter()
for _ in range(1000): k((1,), (32,), (np.uint64(1), np.uint64(2)))
cupy.cuda.runtime.deviceSynchronize(); print("cupy noop launch us", (time.perf_counter() - t) * 1e3)
s = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
t = time.perf_counter()
for _ in range(1000):
    with cupy.cuda.Device(0), s: k((1,), (32,), (np.uint64(1), np.uint64(2)))
print("cupy noop launch with contexts us", (time.perf_counter() - t) * 1e3)
t = time.perf_counter()
for _ in range(1000): torch.cuda.current_stream(torch.device('cuda', 0))
print("torch current_stream us", (time.perf_counter() - t) * 1e3)
