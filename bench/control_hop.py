"""What one control message and one same-host GPU write cost between two processes on this host:
the floor under a one-block transfer (submit → write → announce → DONE).

    python bench/control_hop.py [--n 3000] [--device cuda|cpu] [--json FILE]

- round trips of a 40-byte message over TCP loopback and over a Unix socket, with blocking
  sockets and with asyncio streams (what the sidecars use) on asyncio's own loop and on uvloop,
  median / p99 µs;
- one HTTP request to a real sidecar: raw on a socket, and through the SDK (``kvferry.client.Client``);
- on a GPU: a 2 MiB copy into memory another process lent by CUDA IPC, then waiting for it
  (``stream.synchronize`` and an event polled with ``query``), median / p99 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESSAGE = b"x" * 40


def _summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"median_us": statistics.median(ordered) * 1e6, "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
            "n": len(ordered)}


def _echo_blocking(family: int, address) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind(address)
        server.listen()
        conn, _ = server.accept()
        if family == socket.AF_INET:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(64):
            conn.sendall(data)


async def _echo_async(family: int, address) -> None:
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(64):
            writer.write(data)
        writer.close()
        done.set_result(None)

    server = await (asyncio.start_server(serve, *address) if family == socket.AF_INET
                    else asyncio.start_unix_server(serve, address))
    async with server:
        await done


def _address(family: int):
    if family == socket.AF_INET:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()
    return os.path.join(tempfile.mkdtemp(), "hop.sock")


def _connect(family: int, address) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.connect(address)
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    if family == socket.AF_INET:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _run(mode: str, coroutine) -> None:
    if mode == "uvloop":
        import uvloop

        uvloop.run(coroutine)
    else:
        asyncio.run(coroutine)


def round_trips(family: int, mode: str, n: int) -> dict:
    address = _address(family)
    target = _echo_blocking if mode == "blocking" else (lambda f, a: _run(mode, _echo_async(f, a)))
    process = mp.get_context("fork").Process(target=target, args=(family, address), daemon=True)
    process.start()
    seconds: list[float] = []
    if mode == "blocking":
        with _connect(family, address) as s:
            for _ in range(n):
                started = time.perf_counter()
                s.sendall(MESSAGE)
                s.recv(64)
                seconds.append(time.perf_counter() - started)
    else:
        async def client() -> None:
            reader, writer = await asyncio.open_connection(sock=_connect(family, address))
            for _ in range(n):
                started = time.perf_counter()
                writer.write(MESSAGE)
                await reader.read(64)
                seconds.append(time.perf_counter() - started)
            writer.close()
        _run(mode, client())
    process.join(timeout=10)
    return _summary(seconds[n // 10:])


def _lender(conn) -> None:
    import torch

    from kvferry.engine import ipc

    target = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    conn.send(ipc.export(target))
    conn.recv()


def gpu_write(n: int) -> dict:
    import torch

    from kvferry.engine import ipc, peer

    context = mp.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_lender, args=(there,), daemon=True)
    process.start()
    handle, offset, uuid = here.recv()
    remote = ipc.Mapper().tensor(peer.Target(handle, offset, uuid, 4), (4, 2 << 20), torch.uint8)
    source = torch.ones(4, 2 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out = {}
    for how in ("synchronize", "event.query", "local copy, synchronize"):
        seconds = []
        destination = torch.empty_like(source) if how.startswith("local") else remote
        for i in range(n):
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                destination[i % 4].copy_(source[(i + 1) % 4], non_blocking=True)
                if how == "event.query":
                    event = torch.cuda.Event()
                    event.record(stream)
                    while not event.query():
                        pass
                else:
                    stream.synchronize()
            seconds.append(time.perf_counter() - started)
        out[how] = _summary(seconds[n // 10:])
    here.send(None)
    process.join(timeout=10)
    return out


def http_calls(n: int) -> dict:
    """One request to a real sidecar (``kvferry serve``): raw HTTP/1.1 on a socket, then through
    the SDK, unauthenticated (``/healthz``) and through the auth dependency."""
    from kvferry.client import Client
    from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

    port = free_port()
    process = start_sidecar(port, free_port(), "tcp", device="cpu")
    out = {}
    try:
        client = Client(f"http://127.0.0.1:{port}", timeout=30)
        wait_ready(client, process, timeout=120)
        with _connect(socket.AF_INET, ("127.0.0.1", port)) as s:
            seconds = []
            for _ in range(n):
                started = time.perf_counter()
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = b""
                while not reply.endswith(b"}"):
                    reply += s.recv(4096)
                seconds.append(time.perf_counter() - started)
            out["GET /healthz, raw socket"] = _summary(seconds[n // 10:])
        for path in ("/healthz", "/v1/health"):
            seconds = []
            for _ in range(n):
                started = time.perf_counter()
                client._call("GET", path)
                seconds.append(time.perf_counter() - started)
            out[f"GET {path}, SDK"] = _summary(seconds[n // 10:])
        client.close()
    finally:
        stop_sidecars([process])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where there is one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = {}
    print("| what | median µs | p99 µs |\n|---|---:|---:|")
    for family, name in ((socket.AF_INET, "tcp loopback"), (socket.AF_UNIX, "unix socket")):
        for mode in ("blocking", "asyncio", "uvloop"):
            row = rows[f"{name}, {mode}, round trip"] = round_trips(family, mode, args.n)
            print(f"| {name}, {mode}, round trip | {row['median_us']:.1f} | {row['p99_us']:.1f} |", flush=True)
    for what, row in http_calls(min(args.n, 2000)).items():
        rows[what] = row
        print(f"| {what} | {row['median_us']:.1f} | {row['p99_us']:.1f} |", flush=True)
    import torch

    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        for how, row in gpu_write(args.n).items():
            rows[f"2 MiB GPU copy, {how}"] = row
            print(f"| 2 MiB copy into CUDA IPC memory, {how} | {row['median_us']:.1f} | {row['p99_us']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"host": os.uname().nodename, "command": " ".join(sys.argv), "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
