"""Session 20: what the connector harness's request costs piece by piece, in process (us per call)."""
import asyncio, json, time, timeit, statistics, sys
sys.path.insert(0, ".")
import numpy as np
import torch
from kvferry.engine.blocks import Blocks, Ids, _outer
from kvferry.engine import peer
from kvferry.api.models import TransferBody, to_blocks
from kvferry.codec import blockcopy

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
blocks, planes = 2 * 256 + 16, 64
ids = tuple(range(0, 512, 2))[:256]
b = Blocks(ids=ids, spread=(planes, blocks))

def us(f, n=2000):
    f()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return f"{statistics.median(runs):8.1f}"

print("Ids.of spread 256x64      ", us(lambda: Ids.of(b, blocks * planes)))
print("_outer                    ", us(lambda: _outer(ids, planes, blocks)))
print("np.add.outer only         ", us(lambda: np.add.outer(np.fromiter(ids, np.int64, 256), np.arange(0, planes * blocks, blocks))))
print("set(ids)                  ", us(lambda: len(set(ids))))
a = peer.Announce("raw", "bfloat16", b, (peer.PairLayout("d", (16, 8, 128), 4096),), flags=1)
m = peer.Message("0" * 31 + "1", a)
raw = peer.pack(m)
print("peer.pack announce        ", us(lambda: peer.pack(m)))
print("peer.unpack announce      ", us(lambda: peer.unpack(raw)))
body = json.dumps({"src_region": "src", "dst_region": "dst", "src_blocks": {"ids": list(ids), "count": planes, "stride": blocks},
                   "dst_blocks": {"ids": list(ids), "count": planes, "stride": blocks}, "peer": "127.0.0.1:1", "codec": "raw"}).encode()
print("TransferBody validate     ", us(lambda: TransferBody.model_validate_json(body), 500))
print("json.dumps body           ", us(lambda: json.dumps(json.loads(body)), 500))
print("uuid4().hex               ", us(lambda: __import__("uuid").uuid4().hex))
if dev.type == "cuda":
    src = torch.empty(blocks * planes, 16 * 8 * 128, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    i1, i2 = Ids.of(b, blocks * planes), Ids.of(b, blocks * planes)
    def with_():
        x, y = Ids.of(b, blocks * planes), Ids.of(b, blocks * planes)
        return x.with_(y, dev)
    print("Ids.of x2 + with_ (H2D)   ", us(with_, 500))
    s, d = with_()
    torch.cuda.synchronize()
    def launch():
        blockcopy.copy_blocks(src, s, dst, d)
    print("copy_blocks launch+sync   ", us(lambda: (launch(), torch.cuda.synchronize()), 200))
    t0 = time.perf_counter(); launch(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"one copy: launch {1e6*(t1-t0):.1f} us, then sync {1e6*(t2-t1):.1f} us (512 MiB)")
    base = torch.tensor(ids, dtype=torch.int64)
    def gpu_spread():
        g = base.to(dev, non_blocking=False)
        return (g[:, None] + torch.arange(0, planes * blocks, blocks, device=dev)[None, :]).view(-1)
    print("spread built on GPU       ", us(lambda: (gpu_spread(), torch.cuda.synchronize()), 500))
    pinned = torch.empty(2 * 16384, dtype=torch.int64).pin_memory()
    host = torch.cat((s.cpu(), d.cpu()))
    def h2d_pinned():
        pinned.copy_(host)
        return pinned.to(dev, non_blocking=True)
    print("H2D 2x16384 ids via pinned", us(lambda: (h2d_pinned(), torch.cuda.synchronize()), 500))
    print("H2D 2x16384 ids pageable  ", us(lambda: (host.to(dev), torch.cuda.synchronize()), 500))
    print("torch.cuda.synchronize    ", us(torch.cuda.synchronize))
