"""Per-message cost of the transport between two processes: one send in flight at a time, its
time from send() to the receiver's acknowledgement; CUDA buffers over ucxx (cuda_ipc) or tcp.
Usage: python3 msg_cost.py --backend ucxx --sizes 2M,24M,192M --count 40 [--fresh]"""
import argparse, asyncio, json, statistics, subprocess, sys, time
import torch, os
if os.environ.get('KVF_MTL'):
    import mtl  # noqa
from kvferry.transport import TransportConfig, connect, listen, shutdown_backends
from kvferry.transport.bench import parse_size


def config(args):
    return TransportConfig(backend=args.backend, chunk_bytes=max(parse_size(s) for s in args.sizes.split(",")) + (1 << 20),
                           max_inflight_bytes=1 << 31)


async def spinner():
    while True:
        await asyncio.sleep(0)


async def serve(args):
    if args.spin:
        asyncio.ensure_future(spinner())
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    buffers = {n: [torch.empty(n, dtype=torch.uint8, device=args.device) for _ in range(2)] for n in sizes}
    listener = await listen("127.0.0.1", 0, config(args))
    print(json.dumps({"port": listener.port}), flush=True)
    tag = 0
    for n in sizes:
        for i in range(args.count):
            receive = listener.expect(tag, buffers[n][i % 2])
            await receive.wait(30)
            tag += 1
    await asyncio.sleep(0.3)
    await listener.close()
    shutdown_backends()


async def send(args, port):
    if args.spin:
        asyncio.ensure_future(spinner())
    connection = await connect("127.0.0.1", port, config(args))
    tag, keep = 0, []
    for s in args.sizes.split(","):
        n = parse_size(s)
        payload = torch.randint(0, 255, (n,), dtype=torch.uint8, device=args.device)
        times = []
        for i in range(args.count):
            if args.fresh:
                payload = payload.clone()
                keep.append(payload)
            if args.device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            await connection.send(tag, payload, eager=args.eager)
            times.append(time.perf_counter() - t)
            tag += 1
        w = times[2:]
        print(f"{args.backend} spin={args.spin} {'fresh' if args.fresh else 'same'} {s:>5}: median {statistics.median(w)*1e3:.3f} ms, "
              f"min {min(w)*1e3:.3f}, GB/s {n/statistics.median(w)/1e9:.1f}", flush=True)
    await connection.close()
    shutdown_backends()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="ucxx")
    p.add_argument("--sizes", default="2M,24M,192M")
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--spin", action="store_true")
    p.add_argument("--role", default="")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.role == "server":
        asyncio.run(serve(args)); return
    cmd = [sys.executable, __file__, "--role", "server", "--backend", args.backend, "--sizes", args.sizes, "--count", str(args.count), "--device", args.device] + ["--spin"] * args.spin
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("{"):
            port = json.loads(line)["port"]; break
    asyncio.run(send(args, port))
    proc.wait(timeout=60)


main()
