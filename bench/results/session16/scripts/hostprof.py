"""Host time of launching SplitZip's block encode and decode (256 MiB of [32,2,16,8,128] bf16 blocks),
and a cProfile of each, on the device."""
import cProfile, pstats, statistics, time, io
import torch
from kvferry import codec as codecs
from kvferry.codec import staging

torch.manual_seed(0)
cache = (torch.randn(256, 32, 2, 16, 8, 128, device="cuda") * 0.05).to(torch.bfloat16)
out = torch.zeros_like(cache)
ids = torch.randperm(256, device="cuda")[:128].contiguous()
dst = torch.randperm(256, device="cuda")[:128].contiguous()
sz = codecs.get("splitzip")
book = sz.learn(cache[:8])
stream = torch.cuda.Stream()

def one(kind):
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        if kind == "enc":
            p = sz.start_encode_blocks(cache, ids, book)
        else:
            p = sz.start_decode_blocks(frame, out, dst, book)
        t1 = time.perf_counter()
        r = p.result()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, r

frame = one("enc")[2]
for kind in ("enc", "dec"):
    for _ in range(5):
        one(kind)
    launch, wait = [], []
    for _ in range(50):
        a, b, _r = one(kind)
        launch.append(a); wait.append(b)
    print(f"{kind}: launch median {statistics.median(launch)*1e3:.3f} ms  min {min(launch)*1e3:.3f}  wait median {statistics.median(wait)*1e3:.3f}")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(30):
        one(kind)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:4000])
# pieces
def t(label, fn, n=200):
    for _ in range(5): fn()
    ts = []
    for _ in range(n):
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    print(f"{label:40s} {statistics.median(ts)*1e6:8.1f} us")
with torch.cuda.stream(stream):
    t("torch.empty pinned 8", lambda: torch.empty(8, dtype=torch.uint8, pin_memory=True))
    t("torch.empty cuda 256M", lambda: torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    t("Event()+record", lambda: torch.cuda.Event().record(torch.cuda.current_stream(cache.device)))
    t("start_read 8", lambda: staging.start_read(frame, 8))
    t("current_stream(device)", lambda: torch.cuda.current_stream(cache.device))
    t("torch.cuda.stream ctx", lambda: torch.cuda.stream(stream).__enter__())
