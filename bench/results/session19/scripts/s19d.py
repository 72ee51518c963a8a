"""Per-transfer times of 1 GiB entropy / splitzip transfers on an emulated link: which ones are slow, and where."""
import json, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
sys.path.insert(0, str(Path.cwd() / "bench"))
import torch
from peers import tiled_cache, plan, BLOCK_BYTES
from kvferry.client import Client
from kvferry.demo import LLAMA_AXES, free_port, settle, start_sidecar, stop_sidecars, wait_ready

link = sys.argv[1] if len(sys.argv) > 1 else "25"
codecs = (sys.argv[2] if len(sys.argv) > 2 else "entropy,splitzip").split(",")
n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
blocks_total = 2048
count = int(sys.argv[4]) if len(sys.argv) > 4 else 512
dev = "cuda" if torch.cuda.is_available() else "cpu"
kind = "cuda_ipc" if dev == "cuda" else "shm"
if dev == "cpu": blocks_total = 16
ports = [(free_port(), free_port()) for _ in range(2)]
env = {"KVFERRY_TRANSFER_TIMEOUT": "120", "UCX_TLS": "tcp,cuda_copy,cuda_ipc", "KVFERRY_LINK_GBPS": link}
procs = [start_sidecar(p, d, "ucxx", env=env, device=dev, log=Path(f"/tmp/sc{i}.log")) for i, (p, d) in enumerate(ports)]
try:
    s, r = (Client(f"http://127.0.0.1:{p}", timeout=300) for p, _ in ports)
    for c, p in zip((s, r), procs):
        wait_ready(c, p, timeout=240)
    src = tiled_cache(blocks_total, dev)
    dst = torch.zeros_like(src)
    _, h1 = s.region_from_tensor("src", src, kind=kind, axes=LLAMA_AXES)
    _, h2 = r.region_from_tensor("dst", dst, kind=kind, axes=LLAMA_AXES)
    peer = r.data_address()
    for codec in codecs:
        rows = []
        for i in range(n + 2):
            si, di = plan(blocks_total, count, seed=i * 7919 + 1)
            t0 = time.perf_counter()
            rec = s._call("POST", "/v1/transfers", params={"wait": 300}, json={
                "src_region": "src", "dst_region": "dst", "src_blocks": si, "dst_blocks": di, "peer": peer, "codec": codec}).json()
            wall = time.perf_counter() - t0
            if i == 0:
                settle(s, "src")
            rows.append((i, rec["id"], rec["seconds"] * 1e3, wall * 1e3, {k: round(v * 1e3, 2) for k, v in rec["stages"].items()},
                         rec["bytes_raw"] / max(1, rec["bytes_wire"])))
            time.sleep(0.05)
        incoming = {x["id"]: x for x in r._call("GET", "/v1/transfers", params={"direction": "in", "limit": 100}).json()}
        for i, tid, sec, wall, st, ratio in rows:
            x = incoming.get(tid, {})
            print(f"{link} {codec} #{i:2d} {sec:8.2f} ms (client {wall:8.2f}) ratio {ratio:.3f} S {st} R {x.get('seconds', 0)*1e3:.2f} {({k: round(v*1e3, 2) for k, v in x.get('stages', {}).items()})}")
        secs = [x[2] for x in rows[2:]]
        print(f"{link} {codec} median {statistics.median(secs):.2f} max {max(secs):.2f}")
    print(r._call("GET", "/v1/regions/dst").json().get("learned"), s._call("GET", "/v1/regions/src").json().get("learned"))
finally:
    stop_sidecars(procs)
    for i in range(2):
        print(f"--- sidecar {i} log tail"); print("".join(open(f"/tmp/sc{i}.log").readlines()[-8:]))
