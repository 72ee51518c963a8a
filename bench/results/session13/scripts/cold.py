"""Are the sidecar's slow CUDA calls a cold CPU (idle gaps between requests)? Resolve with gaps."""
import os, statistics, struct, sys, time
sys.path.insert(0, ".")
import torch
from kvferry.engine.blocks import Blocks

dev = torch.device("cuda")
b = Blocks(ids=tuple(range(0, 512, 2)), spread=(64, 8208))
N = 8208 * 64

def spin(s):
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass

def t(fn, gap, mode, n=200):
    for _ in range(10): fn()
    xs, cs = [], []
    for _ in range(n):
        if gap:
            (time.sleep if mode == "sleep" else spin)(gap)
        a, c = time.perf_counter(), time.thread_time()
        fn()
        xs.append(time.perf_counter() - a); cs.append(time.thread_time() - c)
    return f"{statistics.median(xs) * 1e6:7.1f} us (cpu {statistics.median(cs) * 1e6:6.1f})"

def table(label):
    for gap, mode in ((0, "-"), (0.0005, "sleep"), (0.002, "sleep"), (0.01, "sleep"), (0.002, "spin")):
        print(f"{label:10s} gap {gap * 1e3:4.1f} ms {mode:5s} resolve {t(lambda: b.resolve(N, dev), gap, mode)}"
              f"  tensor(list) {t(lambda: torch.tensor([1, 2, 3], device=dev), gap, mode)}"
              f"  empty py {t(lambda: sum(range(200)), gap, mode)}", flush=True)

torch.zeros(1, device=dev)
table("default")
try:
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", 0))
    table("dma_lat=0")
    os.close(fd)
except OSError as e:
    print("no /dev/cpu_dma_latency:", e)
print("cpu governor:", open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read().strip() if os.path.exists("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") else "n/a")
os.system("cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null; ls /sys/devices/system/cpu/cpu0/cpuidle 2>/dev/null | head; nproc; lscpu | grep -i 'model name\\|mhz'")
