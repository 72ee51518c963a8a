"""Loopback throughput: ``python bench/transport_bench.py --backend {ucxx,tcp} --size 256MiB --count N
[--device cuda:0] [--lanes L]``.

Runs a receiving process and a sending process on 127.0.0.1 and prints one line ending in GB/s
(payload bytes / seconds from the first announcement to the last acknowledgement). With
``--baseline`` it first measures raw blocking sockets (sendall / recv_into) between two
processes the same way, over as many streams as ``--lanes`` (a thread each), and the main line
reports the ratio to it. ``--device cuda:N`` moves
CUDA buffers (torch tensors) instead of host memory: GPU to GPU through UCX where it can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry.transport.backends import shutdown_backends  # noqa: E402
from kvferry.transport.config import TransportConfig  # noqa: E402
from kvferry.transport.endpoint import connect, listen  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


async def _serve(args: argparse.Namespace) -> None:
    config = TransportConfig(backend=args.backend, chunk_bytes=args.chunk, max_inflight_bytes=args.window,
                             encrypt=args.encrypt, tcp_lanes=args.lanes)
    buffers = [_buffer(args), _buffer(args)]  # before UCX starts: it finds CUDA as the daemon does
    listener = await listen("127.0.0.1", 0, config)
    print(json.dumps({"port": listener.port}), flush=True)
    for i in range(args.count):
        receive = listener.expect(i, buffers[i % 2])
        await receive.wait(config.op_timeout)
    await asyncio.sleep(0.2)
    await listener.close()
    shutdown_backends()


async def _send(args: argparse.Namespace, port: int) -> float:
    config = TransportConfig(backend=args.backend, chunk_bytes=args.chunk, max_inflight_bytes=args.window,
                             encrypt=args.encrypt, tcp_lanes=args.lanes)
    payload = _buffer(args)
    connection = await connect("127.0.0.1", port, config)
    start = time.perf_counter()
    pending = set()
    for i in range(args.count):  # two transfers in flight, so the pipe never drains between them
        pending.add(asyncio.create_task(connection.send(i, payload)))
        if len(pending) == 2:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    for task in pending:
        await task
    elapsed = time.perf_counter() - start
    await connection.close()
    shutdown_backends()
    return elapsed


def _buffer(args: argparse.Namespace):
    if args.device == "cpu":
        return bytearray(args.size)
    import torch

    return torch.ones(args.size, dtype=torch.uint8, device=args.device)


def _raw_serve(size: int, count: int, streams: int, host: str = "127.0.0.1") -> None:
    """Receive ``count`` messages of ``size`` bytes over ``streams`` sockets, each message cut in
    one equal piece per socket, a thread per socket (as the tcp backend's lanes)."""
    server = socket.socket()
    server.bind((host, 0))
    server.listen(streams)
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    conns = [server.accept()[0] for _ in range(streams)]
    piece = size // streams

    def receive(conn: socket.socket) -> None:
        buf = memoryview(bytearray(piece))
        for _ in range(count):
            got = 0
            while got < piece:
                got += conn.recv_into(buf[got:], piece - got, socket.MSG_WAITALL)

    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(receive, conns))
    conns[0].sendall(b"k")
    for conn in conns:
        conn.close()


def _raw_send(port: int, size: int, count: int, streams: int, host: str = "127.0.0.1") -> float:
    socks = [socket.create_connection((host, port)) for _ in range(streams)]
    payload = memoryview(bytearray(size // streams))

    def send(sock: socket.socket) -> None:
        for _ in range(count):
            sock.sendall(payload)

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(send, socks))
    socks[0].recv(1)
    elapsed = time.perf_counter() - start
    for sock in socks:
        sock.close()
    return elapsed


def _spawn(role: str, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--backend", args.backend,
               "--size", str(args.size), "--count", str(args.count), "--chunk", str(args.chunk),
               "--window", str(args.window), "--device", args.device, "--lanes", str(args.lanes),
               *(["--encrypt"] if args.encrypt else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:  # UCX may print its own warnings on stdout first
        if line.startswith("{"):
            return process, json.loads(line)["port"]
    process.kill()
    raise RuntimeError(f"{role} process exited before reporting its port")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("ucxx", "tcp"), default="tcp")
    parser.add_argument("--size", type=parse_size, default=parse_size("256MiB"))
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--chunk", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--window", type=parse_size, default=parse_size("128MiB"))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for GPU buffers")
    parser.add_argument("--baseline", action="store_true",
                        help="also measure raw blocking sockets, as many streams as --lanes, host memory")
    parser.add_argument("--encrypt", action="store_true", help="encrypt payloads (AES-256-GCM) as well as authenticate them")
    parser.add_argument("--lanes", type=int, default=1, help="tcp: sockets per connection (the sender dials them)")
    parser.add_argument("--role", choices=("server", "raw-server", "raw-send"), help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)  # raw roles: the receiver's address
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server":
        asyncio.run(_serve(args))
        return
    if args.role == "raw-server":
        _raw_serve(args.size, args.count, args.lanes, args.host)
        return
    if args.role == "raw-send":
        print(json.dumps({"seconds": _raw_send(args.port, args.size, args.count, args.lanes, args.host)}), flush=True)
        return
    total = args.size * args.count
    raw_rate = None
    if args.baseline:
        process, port = _spawn("raw-server", args)
        raw_rate = total / _raw_send(port, args.size, args.count, args.lanes) / 1e9
        process.wait(timeout=60)
        print(f"raw-sockets size={args.size >> 20}MiB count={args.count} streams={args.lanes} {raw_rate:.2f} GB/s",
              flush=True)
    process, port = _spawn("server", args)
    rate = total / asyncio.run(_send(args, port)) / 1e9
    process.wait(timeout=60)
    ratio = f" ratio_vs_raw={rate / raw_rate:.2f}" if raw_rate else ""
    print(f"{args.backend} device={args.device} size={args.size >> 20}MiB count={args.count} "
          f"chunk={args.chunk >> 20}MiB lanes={args.lanes}{ratio} {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
