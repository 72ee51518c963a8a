import sys, statistics, torch
sys.path.insert(0, '.')
import codec
from codec import splitzip_gpu
from codec.bench import kv_source, tile

def t(fn, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts=[]
    for _ in range(reps):
        a,b=torch.cuda.Event(True),torch.cuda.Event(True); a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b)/1e3)
    return statistics.median(ts)

calib, data, _ = kv_source()
n = 1 << 28
x = tile(data, n).to(torch.bfloat16).cuda()
book = codec.calibrate([calib.to(torch.bfloat16)])
ref = codec.frames._encode(x[:1<<22], book, checksum=False, chunk=1024, force=None)
variants = [(32,8),(32,1),(16,1),(32,12)]
for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2):
    y = x.to(dtype); b = codec.calibrate([calib.to(dtype)]); raw = y.numel()*y.element_size()
    refd = codec.frames._encode(y[:1<<22], b, checksum=False, chunk=1024, force=None)
    for lanes, minb in variants:
        if dtype != torch.bfloat16 and (lanes, minb) not in [(32,1),(16,1),(8,1)]: continue
        splitzip_gpu.TUNING = {"LANES": lanes, "MINB": minb}
        ok = torch.equal(codec.encode(y[:1<<22], b), refd)
        f = codec.encode(y, b); out = torch.empty_like(y); codec.decode(f, out=out)
        ok &= torch.equal(out.view(torch.uint8), y.view(torch.uint8))
        te = t(lambda: codec.encode(y, b)); td = t(lambda: codec.decode(f, out=out))
        fn = splitzip_gpu._kernel(0, f"encode_dense{splitzip_gpu._template(codec.layout_for(dtype))}", tuple(sorted(splitzip_gpu.TUNING.items())))
        fd = splitzip_gpu._kernel(0, f"decode_chunks{splitzip_gpu._template(codec.layout_for(dtype))}", tuple(sorted(splitzip_gpu.TUNING.items())))
        print(f"{str(dtype):22s} lanes={lanes:2d} minb={minb:2d} regs enc={fn.function.num_regs} dec={fd.function.num_regs} exact={ok} enc {raw/te/1e9:7.1f} GB/s  dec {raw/td/1e9:7.1f} GB/s", flush=True)
