"""Time the segmented CRC on the GPU: the committed kernel vs this tree's, whole calls."""
import statistics, sys, time
import torch
sys.path.insert(0, "bench/.prof")
import checksum_old
from kvferry.transport import checksum
for size in (2 << 20, 64 << 20, 193 << 20):
    x = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    assert checksum.device_segmented_crc(x) == checksum_old.device_segmented_crc(x)
    for name, f in (("old", checksum_old.device_segmented_crc), ("new", checksum.device_segmented_crc)):
        f(x); torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            t = time.perf_counter(); f(x); ts.append(time.perf_counter() - t)
        m = statistics.median(ts)
        print(f"{name} {size >> 20} MiB: {m * 1e3:.3f} ms, {size / m / 1e9:.1f} GB/s")
