# sitecustomize for the sidecars: time Blocks.resolve on the GPU as the sidecar calls it, step by step.
import os
if os.environ.get("KVF_RES"):
    import statistics, time
    import torch
    if os.environ.get("KVF_BLOCKING_SYNC"):
        import ctypes, glob
        libs = sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*")) + sorted(glob.glob("/usr/local/lib/python3*/*-packages/nvidia/cuda_runtime/lib/libcudart.so*"))
        rt = ctypes.CDLL(libs[0])
        print("cudaSetDeviceFlags(BlockingSync):", rt.cudaSetDeviceFlags(4), libs[0], flush=True)
    from kvferry.engine import blocks as _b
    _orig = _b.Blocks.resolve
    _rows = []
    def resolve(self, num_blocks, device="cpu"):
        if torch.device(device).type != "cuda" or self.spread is None:
            return _orig(self, num_blocks, device)
        idle = torch.cuda.current_stream().query()
        t = [time.perf_counter()]; c = [time.thread_time()]
        out = _orig(self, num_blocks, device)
        t.append(time.perf_counter()); c.append(time.thread_time())
        host = torch.tensor(self.ids, dtype=torch.int64)
        t.append(time.perf_counter()); c.append(time.thread_time())
        dev = host.to(device)
        t.append(time.perf_counter()); c.append(time.thread_time())
        r = torch.arange(self.spread[0], dtype=torch.int64, device=device)
        t.append(time.perf_counter()); c.append(time.thread_time())
        (dev[:, None] + r * self.spread[1]).reshape(-1)
        t.append(time.perf_counter()); c.append(time.thread_time())
        torch.cuda.current_stream().synchronize()
        t.append(time.perf_counter()); c.append(time.thread_time())
        _rows.append([b - a for a, b in zip(t, t[1:])] + [b - a for a, b in zip(c, c[1:])] + [0.0 if idle else 1.0])
        if len(_rows) % 10 == 0:
            with open("/tmp/resolve.txt", "a") as fh:
                fh.write(f"{os.getpid()} wall: resolve,host,h2d,arange,ops,sync | cpu: same | busy "
                         f"{[round(statistics.median(x) * 1e6, 1) for x in zip(*_rows[-10:])]}\n")
        return out
    _b.Blocks.resolve = resolve
