"""What sealing messages costs (``kvferry.transport.seal``): GMAC and AES-256-GCM encryption of
host payloads on one core, and the device digest of GPU payloads beside a device copy of the same
bytes in the same run, per call as the transport pays it.

    python bench/seal_cost.py [--sizes 2M,64M,256M] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.transport.seal import Direction  # noqa: E402


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _median_s(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2M,64M,256M")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    seal = Direction(os.urandom(32), encrypt=False)
    print("| size | host GMAC GB/s | host AES-GCM GB/s | device digest ms (GB/s) | device copy ms |")
    print("|---:|---:|---:|---:|---:|")
    for size in (_size(s) for s in args.sizes.split(",")):
        host = bytearray(os.urandom(size))
        gmac = size / _median_s(lambda: seal.payload_tag(1, host), args.repeats) / 1e9
        aead = size / _median_s(lambda: seal.seal(1, host), max(3, args.repeats // 4)) / 1e9
        device = "—"
        copy = "—"
        if torch.cuda.is_available():
            x = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
            y = torch.empty_like(x)
            digest_s = _median_s(lambda: seal.digest(x)(), args.repeats)
            copy_s = _median_s(lambda: (y.copy_(x), torch.cuda.synchronize()), args.repeats)
            device, copy = f"{digest_s * 1e3:.3f} ({size / digest_s / 1e9:.0f})", f"{copy_s * 1e3:.3f}"
        print(f"| {size >> 20} MiB | {gmac:.1f} | {aead:.2f} | {device} | {copy} |")


if __name__ == "__main__":
    main()
