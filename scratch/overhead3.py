import sys, time, torch, numpy as np
sys.path.insert(0, '.')
import codec
from codec import splitzip_gpu as g
x = torch.randn(1 << 21).to(torch.bfloat16).cuda()
book = codec.calibrate(x)
buf = torch.empty(codec.frame_capacity(x.shape, x.dtype), dtype=torch.uint8, device='cuda')
layout = codec.layout_for(x.dtype)
for _ in range(20): codec.encode_into(x, book, buf)
torch.cuda.synchronize()
N = 300
def clock(label, fn):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"{label:40s} {(t1 - t) / N * 1e6:8.1f} us/call cpu, drain {(time.perf_counter() - t1) * 1e3:.2f} ms", flush=True)
dev = x.device
plan = g._encode_plan(layout, tuple(x.shape), 1024, book.exponents, dev, g._tuning())
clock("codec.encode_into", lambda: codec.encode_into(x, book, buf))
clock("splitzip_gpu.encode_into", lambda: g.encode_into(x, None, 0, tuple(x.shape), layout, book.exponents, 1024, buf))
clock("plan lookup", lambda: g._encode_plan(layout, tuple(x.shape), 1024, book.exponents, dev, g._tuning()))
clock("current_stream", lambda: torch.cuda.current_stream(dev).cuda_stream)
clock("2x torch.empty", lambda: (torch.empty(plan.nchunks + 1, dtype=torch.int64, device=dev), torch.empty(plan.nchunks * 1024 * 3, dtype=torch.uint8, device=dev)))
c = torch.zeros(plan.nchunks + 1, dtype=torch.int64, device=dev)
clock("cumsum", lambda: torch.cumsum(c[:-1], 0))
s = torch.cuda.current_stream(dev).cuda_stream
clock("np.uint64 x 20", lambda: [np.uint64(i) for i in range(20)])
clock("_frames checks (_check_tensor+_codebook_for)", lambda: (codec.frames._check_tensor(x), codec.frames._codebook_for(x, book, layout, 1024)))
clock("_check_buffer", lambda: codec.frames._check_buffer(buf, dev, codec.frame_capacity(x.shape, x.dtype)))
clock("frame_capacity", lambda: codec.frame_capacity(x.shape, x.dtype))
frame = codec.encode(x, book); out = torch.empty_like(x)
clock("decode 4MiB", lambda: codec.decode(frame, out=out))
clock("read_header", lambda: codec.read_header(frame))
