import sys, time, torch
sys.path.insert(0, '.')
import codec
from torch.profiler import profile, ProfilerActivity
x = torch.randn(1 << 21).to(torch.bfloat16).cuda()
book = codec.calibrate(x)
buf = torch.empty(codec.frame_capacity(x.shape, x.dtype), dtype=torch.uint8, device='cuda')
for _ in range(20): codec.encode_into(x, book, buf)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(200): codec.encode_into(x, book, buf)
t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"cpu per call {(t1-t)/200*1e6:.1f} us, drain {(t2-t1)*1e3:.2f} ms", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20): codec.encode_into(x, book, buf)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50))
