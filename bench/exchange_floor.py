"""The floor under a one-block leased write: what the exchange costs outside the engine, on the
same host, with the same pieces. Two processes, one Unix socket, uvloop; the block copied by one
``cudaMemcpyAsync`` into memory the other process lent by CUDA IPC (``--device cpu``: a host
``memmove`` between this process's own buffers), synchronized; then a 150-byte announce and a
40-byte DONE, each a 48-byte header and its payload sealed as the peer connection seals them (two
AES-GCM tags, ``transport.seal.Direction``), each tag checked on arrival. No records, no state
machine, no metrics: timed at the sender from the copy's launch to the DONE checked.

    python bench/exchange_floor.py [--device cuda|cpu] [--dst-gpu 0] [--block-kib 2048] [--n 600] [--json FILE]

Beside ``bench/peers.py``'s one-block rows (the sender's record, which waits for the same DONE),
the difference is the engine's own work on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = b"exchange-floor-key-of-32-bytes!!"
HEADER = struct.Struct("<8sQQQQQ")  # 48 bytes, as the wire's header
WARM_UP = 50  # writes before the timed ones
_RECEIVER = r"""
import asyncio, socket, struct, sys
sys.path.insert(0, sys.argv[4])
from kvferry.transport.seal import Direction
HEADER = struct.Struct("<8sQQQQQ")
if sys.argv[2] == "cpu":
    print("- 0 -", flush=True)
else:
    import torch
    from kvferry.engine import ipc
    lent = torch.zeros(int(sys.argv[3]), dtype=torch.uint8, device=f"cuda:{sys.argv[2]}")
    handle, offset, uuid = ipc.export(lent)
    print(handle.hex(), offset, uuid.hex(), flush=True)
inn, out = Direction(sys.argv[5].encode(), False), Direction(sys.argv[5].encode(), False)


async def main():
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(bytes.fromhex(sys.argv[1]))
    sock.setblocking(False)

    async def spin():  # as a sidecar's loop does after activity
        while True:
            await asyncio.sleep(0)

    spinning = loop.create_task(spin())
    buffer = bytearray(4096)
    while True:
        n = await loop.sock_recv_into(sock, buffer)
        if n == 0:
            spinning.cancel()
            return
        message, seq = bytes(buffer[:n]), inn.next()
        header, payload_tag, header_tag, payload = message[:48], message[48:64], message[64:80], message[80:]
        if not (inn.check_header(seq, header, payload_tag, header_tag)
                and inn.check_payload(seq, payload, payload_tag)):
            raise SystemExit("a message failed its tags")
        done = payload[:16] + struct.pack("<IQQ", 1, struct.unpack_from("<I", payload, 20)[0], 0)
        seq = out.next()
        tag = out.payload_tag(seq, done)
        head = HEADER.pack(b"kvferryM", 0, len(done), seq, 0, 0)
        sock.send(head + tag + out.header_tag(seq, head, tag) + done)


try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dst-gpu", type=int, default=0, help="the lending process's GPU (the writer is on GPU 0)")
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch

    from kvferry.transport.seal import Direction

    block, blocks = args.block_kib << 10, 16
    name = b"\0kvferry-exchange-floor-" + str(os.getpid()).encode()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(name)
    listener.listen(1)
    where = "cpu" if args.device == "cpu" else str(args.dst_gpu)
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, name.hex(), where, str(blocks * block), str(ROOT),
                                 SECRET.decode()], stdout=subprocess.PIPE, text=True)
    try:
        handle, offset, uuid = receiver.stdout.readline().split()
        connection, _ = listener.accept()
        connection.setblocking(False)
        src = torch.randint(0, 255, (blocks, block), dtype=torch.uint8,
                            device="cpu" if args.device == "cpu" else "cuda:0")
        if args.device == "cpu":
            import ctypes

            dst = torch.zeros_like(src)
            launch = lambda d, s: ctypes.memmove(d, s, block)  # noqa: E731
            wait = lambda: None  # noqa: E731
        else:
            import cupy

            from kvferry.engine import peer
            from kvferry.engine.ipc import Mapper

            target = peer.Target(bytes.fromhex(handle), int(offset), bytes.fromhex(uuid), blocks)
            dst = Mapper().tensor(target, (blocks, block), torch.uint8, torch.device("cuda:0"))
            stream = torch.cuda.Stream("cuda:0")
            copy, raw = cupy.cuda.runtime.memcpyAsync, stream.cuda_stream
            launch = lambda d, s: copy(d, s, block, 4, raw)  # noqa: E731 (cudaMemcpyDefault, as a same-host write)
            wait = stream.synchronize
        out, inn = Direction(SECRET, False), Direction(SECRET, False)
        times = asyncio.run(_exchange(args.n, connection, src, dst, block, blocks, launch, wait, out, inn))
        last = WARM_UP + args.n - 1  # the last write: every earlier one went to other blocks or was overwritten
        exact = torch.equal(dst[last % blocks].cpu(), src[(last * 7) % blocks].cpu())
        connection.close()
    finally:
        receiver.wait(timeout=30)
        listener.close()
    ordered = sorted(times)
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "block_bytes": block,
              "dst_gpu": args.dst_gpu if args.device == "cuda" else None, "n": len(times),
              "median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
              "bit_exact": exact, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    where = f"GPU 0 -> GPU {args.dst_gpu}" if args.device == "cuda" else "host memory"
    print(f"exchange floor, one {args.block_kib} KiB block, {where}: median {result['median_ms']:.3f} ms, "
          f"p90 {result['p90_ms']:.3f} ms, n={result['n']}, bit-exact {'yes' if exact else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


async def _exchange(n, connection, src, dst, block, blocks, launch, wait, out, inn) -> list[float]:
    loop = asyncio.get_running_loop()

    async def spin():
        while True:
            await asyncio.sleep(0)

    spinning = loop.create_task(spin())
    buffer, times = bytearray(4096), []
    for i in range(WARM_UP + n):
        started = time.perf_counter()
        launch(dst.data_ptr() + (i % blocks) * block, src.data_ptr() + ((i * 7) % blocks) * block)
        wait()
        transfer_id = os.urandom(16)
        body = transfer_id + struct.pack("<II", i % blocks, block) + bytes(126)
        seq = out.next()
        tag = out.payload_tag(seq, body)
        head = HEADER.pack(b"kvferryM", 0, len(body), seq, 0, 0)
        connection.send(head + tag + out.header_tag(seq, head, tag) + body)
        got = await loop.sock_recv_into(connection, buffer)
        message, seq = bytes(buffer[:got]), inn.next()
        if not (inn.check_header(seq, message[:48], message[48:64], message[64:80])
                and inn.check_payload(seq, message[80:], message[48:64]) and message[80:96] == transfer_id):
            raise SystemExit("the DONE failed its tags or names another transfer")
        if i >= WARM_UP:
            times.append(time.perf_counter() - started)
    spinning.cancel()
    return times


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    main()
