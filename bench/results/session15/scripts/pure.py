"""Pure ucxx / NIXL round trips between two processes on one GPU, no kvferry: what one message
costs at the library level. Usage: python3 pure.py ucxx|nixl [--size 2M] [--n 200] [--spin] [--mode blocking]"""
import argparse, asyncio, json, os, statistics, subprocess, sys, time
os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
import numpy as np
import torch
DEV = os.environ.get("DEV", "cuda")
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)

def size(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)

async def spinner():
    while True:
        await asyncio.sleep(0)

def report(name, times):
    w = sorted(times[10:])
    print(json.dumps({"case": name, "median_ms": statistics.median(w) * 1e3, "p10_ms": w[len(w) // 10] * 1e3,
                      "p90_ms": w[9 * len(w) // 10] * 1e3}), flush=True)

async def ucxx_server(a):
    import ucxx
    ucxx.init(progress_mode=a.mode)
    done = asyncio.Event()
    buf = torch.empty(size(a.size), dtype=torch.uint8, device=DEV)
    buf = buf if DEV == "cuda" else buf.numpy()
    hdr = np.empty(64, dtype=np.uint8)
    ack = np.zeros(8, dtype=np.uint8)
    async def handler(ep):
        for i in range(a.n):
            if a.header:
                await ep.recv(hdr)
            await ep.recv(buf)
            if a.sync:
                SYNC()
            await ep.send(ack)
        done.set()
    if a.spin:
        asyncio.ensure_future(spinner())
    lst = ucxx.create_listener(handler, 0)
    print(json.dumps({"port": lst.port}), flush=True)
    await done.wait()
    await asyncio.sleep(0.5)

async def ucxx_client(a, port):
    import ucxx
    ucxx.init(progress_mode=a.mode)
    if a.spin:
        asyncio.ensure_future(spinner())
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    buf = torch.randint(0, 255, (size(a.size),), dtype=torch.uint8, device=DEV)
    buf = buf if DEV == "cuda" else buf.numpy()
    hdr = np.zeros(64, dtype=np.uint8)
    ack = np.empty(8, dtype=np.uint8)
    SYNC()
    times = []
    for i in range(a.n):
        t = time.perf_counter()
        if a.header:
            await ep.send(hdr)
        await ep.send(buf)
        await ep.recv(ack)
        times.append(time.perf_counter() - t)
        if a.gap:
            await asyncio.sleep(a.gap)
    report(f"ucxx {a.mode} size={a.size} spin={a.spin} header={a.header} sync={a.sync} gap={a.gap}", times)
    await ep.close()

def nixl_target(a, conn):
    from nixl_cu13 import nixl_agent, nixl_agent_config
    buf = torch.zeros(size(a.size), dtype=torch.uint8, device=DEV)
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(agent.get_reg_descs([buf]))
    descs = agent.get_serialized_descs(agent.get_xfer_descs([buf]))
    conn.send((agent.get_agent_metadata(), descs))
    peer_md = conn.recv()
    peer = agent.add_remote_agent(peer_md)
    seen = 0
    while seen < a.n:
        for who, msgs in agent.get_new_notifs().items():
            for m in msgs:
                seen += 1
                agent.send_notif(peer, m)
        if a.gap:
            time.sleep(0)

def nixl_initiator(a, conn):
    from nixl_cu13 import nixl_agent, nixl_agent_config
    buf = torch.randint(0, 255, (size(a.size),), dtype=torch.uint8, device=DEV)
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(agent.get_reg_descs([buf]))
    md, descs = conn.recv()
    conn.send(agent.get_agent_metadata())
    peer = agent.add_remote_agent(md)
    local = agent.get_xfer_descs([buf])
    remote = agent.deserialize_descs(descs)
    SYNC()
    times = []
    for i in range(a.n):
        tag = f"m{i}".encode()
        t = time.perf_counter()
        h = agent.initialize_xfer("WRITE", local, remote, peer, tag)
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        assert st == "DONE", st
        got = False
        while not got:
            for who, msgs in agent.get_new_notifs().items():
                got = got or tag in msgs
        times.append(time.perf_counter() - t)
        agent.release_xfer_handle(h)
        if a.gap:
            time.sleep(a.gap)
    report(f"nixl size={a.size} gap={a.gap}", times)

def main():
    p = argparse.ArgumentParser()
    p.add_argument("what")
    p.add_argument("--size", default="2M")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--spin", action="store_true")
    p.add_argument("--header", action="store_true")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--gap", type=float, default=0.0)
    p.add_argument("--mode", default="blocking")
    p.add_argument("--role", default="")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    if a.what == "nixl":
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        x, y = ctx.Pipe()
        t = ctx.Process(target=nixl_target, args=(a, y))
        t.start()
        nixl_initiator(a, x)
        t.join(30)
        return
    if a.role == "server":
        asyncio.run(ucxx_server(a)); return
    args = [sys.executable, __file__, "ucxx", "--role", "server", "--size", a.size, "--n", str(a.n), "--mode", a.mode]
    args += ["--spin"] * a.spin + ["--header"] * a.header + ["--sync"] * a.sync
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("{"):
            port = json.loads(line)["port"]; break
    asyncio.run(ucxx_client(a, port))
    proc.wait(timeout=60)

if __name__ == '__main__':
    main()
