"""How long a sidecar's control API answers while it streams 1 GiB SplitZip transfers on a GPU:
GET /v1/health on the sender and on the receiver, pinged back to back from two threads while a
third runs the transfers; and the same pings with no transfer running."""
import statistics, sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import torch
from peers import tiled_cache, BLOCK_SHAPE
from kvferry.client import Client
from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

import os
DEVICE = os.environ.get("DEVICE", "cuda")
BLOCKS = int(os.environ.get("BLOCKS", "1024"))
ports = [(free_port(), free_port()) for _ in range(2)]
env = {"KVFERRY_TRANSFER_TIMEOUT": "120", "UCX_TLS": "tcp,cuda_copy,cuda_ipc"}
procs = [start_sidecar(p, d, "ucxx" if DEVICE == "cuda" else "tcp", env=env, device=DEVICE) for p, d in ports]
try:
    sender, receiver = (Client(f"http://127.0.0.1:{p}", timeout=300) for p, _ in ports)
    for c, pr in zip((sender, receiver), procs):
        wait_ready(c, pr, timeout=180)
    blocks = BLOCKS
    kind = "cuda_ipc" if DEVICE == "cuda" else "shm"
    src = tiled_cache(blocks, DEVICE)
    dst = torch.zeros_like(src)
    keep = [sender.region_from_tensor("src", src, kind=kind)[1], receiver.region_from_tensor("dst", dst, kind=kind)[1]]
    peer = receiver.data_address()
    pingers = [Client(f"http://127.0.0.1:{p}", timeout=30) for p, _ in ports]

    def ping(client, out, stop):
        while not stop.is_set():
            t0 = time.perf_counter(); client.health(); out.append(time.perf_counter() - t0)

    def phase(busy: bool):
        lat = ([], [])
        stop = threading.Event()
        threads = [threading.Thread(target=ping, args=(c, l, stop)) for c, l in zip(pingers, lat)]
        for t in threads: t.start()
        took = []
        if busy:
            for r in range(12):
                ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(r))[:blocks // 2].tolist()
                t0 = time.perf_counter()
                rec = sender.send("src", ids, peer, "dst", ids, codec="splitzip", wait=60)
                assert rec["state"] == "done", rec
                took.append(time.perf_counter() - t0)
        else:
            time.sleep(1.0)
        stop.set()
        for t in threads: t.join()
        for side, l in zip(("sender", "receiver"), lat):
            l.sort()
            print(f"{'busy' if busy else 'idle'} {side:8s} health n={len(l):5d} p50 {statistics.median(l)*1e3:.3f} "
                  f"p99 {l[int(len(l)*0.99)]*1e3:.3f} max {l[-1]*1e3:.3f} ms")
        if took:
            print(f"transfers {blocks // 2 * 2} MiB splitzip median {statistics.median(took[2:])*1e3:.2f} ms")
    phase(False); phase(True)
finally:
    stop_sidecars(procs)
