"""What the payload checksums cost: CRC32C of host payloads (google-crc32c, one core) and the
segmented CRC32C of device payloads (``kvferry.transport.checksum``, on the GPU), per call as the
transport pays it (result on the host), beside the device's copy bandwidth in the same run.

    python bench/checksum.py [--sizes 2M,64M,256M] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.transport import checksum  # noqa: E402


def _size(text: str) -> int:
    return int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]])


def _median_s(work, repeats: int, sync: bool) -> tuple[float, float]:
    times = []
    for _ in range(repeats + 1):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2M,64M,256M")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "no GPU"
    print(f"payload checksums, {time.strftime('%Y-%m-%d')}, {device}\n`{' '.join(sys.argv)}`\n")
    print(f"{'size':>8} {'what':<34} {'median ms':>10} {'p99 ms':>8} {'GB/s':>8}")
    for text in args.sizes.split(","):
        n = _size(text)
        host = torch.randint(0, 256, (n,), dtype=torch.uint8).numpy()
        rows = [("host CRC32C (one core)", lambda: checksum.crc(host.data), False)]
        if gpu:
            data = torch.from_numpy(host).cuda()
            assert checksum.device_segmented_crc(data) == checksum.segmented_crc(host.data)
            scratch = torch.empty_like(data)
            rows += [("device segmented CRC32C", lambda: checksum.device_segmented_crc(data), True),
                     ("device copy (read+write, roofline)", lambda: scratch.copy_(data), True)]
        for name, work, sync in rows:
            median, p99 = _median_s(work, args.repeats, sync)
            print(f"{text:>8} {name:<34} {median * 1e3:>10.3f} {p99 * 1e3:>8.3f} {n / median / 1e9:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
