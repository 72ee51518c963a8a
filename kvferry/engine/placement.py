"""Where the daemon's threads run: next to its GPU, its event loop's on a CPU of its own
(``hold_loop``); and how it shares that GPU (``gpu_sharing``).

On a host of several sockets, each GPU hangs off one NUMA node. A sidecar per GPU whose threads
wander to another node copies its staging buffers and its shared-memory writes across the
sockets' link, and its event loop wakes on a CPU whose caches hold nothing of it. So the daemon
pins every thread it has to the CPUs the kernel lists as local to its GPU's PCI device
(``local_cpulist``), within the CPUs it may use at all (its cgroup's cpuset, a ``taskset``):
what ``torchrun --numa-binding=node`` does for a training process. Threads made later inherit
it, and host memory first touched afterwards (pinned staging, the buffer pool) lands on that node.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SYSFS_PCI = Path("/sys/bus/pci/devices")
MODES = ("auto", "off")  # or a CPU list such as "0-15,32-47"


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a kernel CPU list (``0-3,8,10-11``).

    Raises:
        ValueError: not a CPU list.
    """
    cpus: set[int] = set()
    if not text.strip():
        return cpus
    for part in text.strip().split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text.strip()!r} is not a CPU list (such as 0-3,8)")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{part!r} in {text.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpulist(cpus: set[int]) -> str:
    """The kernel's CPU-list form of ``cpus`` (runs folded: ``0-3,8``)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def check(setting: str) -> None:
    """Raises: ValueError (``cpu_affinity`` is neither a mode nor a CPU list)."""
    if setting not in MODES:
        try:
            if not parse_cpulist(setting):
                raise ValueError("no CPU")
        except ValueError as exc:
            raise ValueError(f"cpu_affinity: {setting!r} is not auto, off or a CPU list such as 0-15,32-47 "
                             f"({exc})") from None


def gpu_pci_address(index: int) -> str:
    """The sysfs name of CUDA device ``index``'s PCI function (``0000:1b:00.0``)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def local_cpus(pci_address: str, sysfs: Path | None = None) -> tuple[set[int], int] | None:
    """(the CPUs local to a PCI device, its NUMA node: -1 where the platform names none), or
    None where sysfs (``SYSFS_PCI`` unless given) does not say (no such device, a VM that hides it)."""
    device = (sysfs or SYSFS_PCI) / pci_address
    try:
        cpus = parse_cpulist((device / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None
    try:
        node = int((device / "numa_node").read_text().strip())
    except (OSError, ValueError):
        node = -1
    return (cpus, node) if cpus else None


def host_gpu_position(pci_address: str, sysfs: Path | None = None) -> int | None:
    """Where a GPU comes among the host's NVIDIA display and 3D controllers, by PCI address (the
    same in every container of the host, whichever GPUs each sees), or None where sysfs does not
    list it."""
    found = []
    for device in (sysfs or SYSFS_PCI).glob("*"):
        try:
            if (device / "vendor").read_text().strip() == "0x10de" and \
                    (device / "class").read_text().strip()[:6] in ("0x0300", "0x0302"):
                found.append(device.name)
        except OSError:
            continue
    return sorted(found).index(pci_address) if pci_address in found else None


def choose(setting: str, allowed: set[int], local: set[int] | None) -> set[int] | None:
    """The CPUs to pin to, or None to leave the threads where they are.

    ``auto``: the GPU's local CPUs that this process may use (None where it has no GPU, sysfs
    does not say, none of them are allowed, or they are all it may use anyway). ``off``: None. A
    CPU list: those of it that are allowed.

    Raises:
        ValueError: a CPU list none of whose CPUs this process may use.
    """
    if setting == "off":
        return None
    if setting == "auto":
        if not local:
            return None
        chosen = local & allowed
        return chosen if chosen and chosen != allowed else None
    wanted = parse_cpulist(setting)
    chosen = wanted & allowed
    if not chosen:
        raise ValueError(f"cpu_affinity: none of {setting} is among the CPUs this process may use "
                         f"({format_cpulist(allowed)})")
    return chosen if chosen != allowed else None


def pin(setting: str, gpu_index: int | None) -> str:
    """Pin every thread of this process as ``setting`` says for a daemon on CUDA device
    ``gpu_index`` (None: on the CPU); returns what was done, for the start-up log.

    Raises:
        ValueError: as ``choose``.
    """
    allowed = os.sched_getaffinity(0)
    local, where = None, "on the CPU" if gpu_index is None else f"GPU {gpu_index}"
    if setting == "auto" and gpu_index is not None:
        local, where = _local_to(gpu_index)
    chosen = choose(setting, allowed, local)
    if chosen is None:
        return f"threads not pinned ({setting}; {where}; may use {format_cpulist(allowed)})"
    unmoved = 0
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), chosen)
        except ProcessLookupError:  # it ended meanwhile
            continue
        except OSError:  # one the kernel will not move (another cpuset): the daemon starts all the same
            unmoved += 1
    left = f"; {unmoved} thread(s) could not be moved" if unmoved else ""
    return f"threads pinned to CPUs {format_cpulist(chosen)} ({setting}; {where}){left}{_fit_threads(len(chosen))}"


def _local_to(gpu_index: int) -> tuple[set[int] | None, str]:
    """The CPUs local to CUDA device ``gpu_index`` (None where that is unknown), and what was
    found, for the log."""
    try:
        address = gpu_pci_address(gpu_index)
    except (AttributeError, RuntimeError) as exc:  # a torch without the PCI fields; a GPU gone
        return None, f"GPU {gpu_index}: no PCI address ({type(exc).__name__}: {exc})"
    found = local_cpus(address)
    if found is None:
        return None, f"GPU {gpu_index} at {address}: sysfs names no local CPUs"
    cpus, node = found
    return cpus, f"GPU {gpu_index} at {address}, NUMA node {node}, local CPUs {format_cpulist(cpus)}"


def _fit_threads(cpus: int) -> str:
    """No more of torch's intra-op threads than CPUs to run them: OpenMP workers that outnumber
    their CPUs spin against each other (32 of them on one CPU kept a daemon from starting within a
    minute). ``cpu_threads``, where set, is applied later and wins."""
    import torch

    threads = torch.get_num_threads()
    if threads <= cpus:
        return ""
    torch.set_num_threads(cpus)
    return f"; torch's threads {threads} -> {cpus}"


LOOP_MODES = ("auto", "off")  # or one CPU's number


def check_loop(setting: str) -> None:
    """Raises: ValueError (``loop_cpu`` is neither a mode nor a CPU's number)."""
    if setting not in LOOP_MODES and not setting.isdigit():
        raise ValueError(f"loop_cpu: {setting!r} is not auto, off or a CPU's number")


def loop_cpu(setting: str, allowed: set[int], gpu_index: int | None) -> int | None:
    """The CPU to hold the event loop's thread on, or None to leave it free.

    ``auto``: for a sidecar of a GPU, one of the CPUs it may use, counted from the last by the
    GPU's place on the host (``gpu_index``: ``host_gpu_position``, where known), so that the
    sidecars of one host's GPUs sharing a set take different CPUs (and
    the first CPUs, which take most interrupts, come last); None for a sidecar on the CPU, whose
    loop does not busy-poll, or with one CPU to use. ``off``: None. A number: that CPU.

    Raises:
        ValueError: a CPU this process may not use.
    """
    if setting == "off" or (setting == "auto" and (gpu_index is None or len(allowed) < 2)):
        return None
    if setting == "auto":
        cpus = sorted(allowed)
        return cpus[-1 - gpu_index % len(cpus)]
    if int(setting) not in allowed:
        raise ValueError(f"loop_cpu: CPU {setting} is not among the CPUs this process may use "
                         f"({format_cpulist(allowed)})")
    return int(setting)


async def hold_loop(setting: str, gpu_index: int | None) -> tuple[str, Callable[[], None]]:
    """Hold the calling thread, the running event loop's, on one CPU (``loop_cpu``); what it was
    done, for the log, and how to let it go again.

    A busy-polling loop that the scheduler moves between CPUs finds cold caches on each: a
    one-block write between two sidecars of one host took 0.30-0.31 ms held and 0.33-0.46 ms not.
    Threads inherit the mask of the thread that starts them, so the loop's worker threads, started
    from it later, come from an executor that gives each back the CPUs the loop had; and uvloop's
    own pool (name look-ups), which it starts on first use, is started first.

    Raises:
        ValueError: as ``loop_cpu``.
    """
    loop = asyncio.get_running_loop()
    allowed = os.sched_getaffinity(0)
    cpu = loop_cpu(setting, allowed, gpu_index)
    if cpu is None:
        return f"event loop not held on a CPU ({setting})", lambda: None
    if type(loop).__module__.startswith("uvloop"):
        await loop.getaddrinfo("localhost", None)
    if getattr(loop, "_default_executor", None) is not None:  # its later threads would inherit the one CPU
        return "event loop not held on a CPU: its worker threads started already", lambda: None
    claim = None
    if setting == "auto":  # past CPUs another sidecar of this host holds its loop on (two of one GPU)
        cpus = sorted(allowed)
        for step in range(len(cpus)):
            cpu = cpus[(cpus.index(cpu) - step) % len(cpus)]
            claim = _claim(cpu)
            if claim is not None:
                break
        else:
            return "event loop not held on a CPU: other sidecars hold theirs on every one", lambda: None
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="kvferry-worker", initializer=os.sched_setaffinity,
                                                 initargs=(0, allowed)))
    os.sched_setaffinity(0, {cpu})

    def let_go() -> None:
        os.sched_setaffinity(0, allowed)
        if claim is not None:
            os.close(claim)

    return f"event loop held on CPU {cpu} ({setting}; its workers on {format_cpulist(allowed)})", let_go


LOOP_CLAIMS = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _claim(cpu: int, folder: Path | None = None) -> int | None:
    """A lock on ``cpu`` that this process holds while it lives (a file descriptor to close), or
    None where another process holds it (or made its file, which is not this one's to open)."""
    path = (folder or LOOP_CLAIMS) / f"kvferry-loop-cpu-{cpu}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's, where CUDA_MPS_PIPE_DIRECTORY is not set


def gpu_sharing(environ: dict[str, str] | None = None, default: str = MPS_PIPE_DIRECTORY) -> str:
    """How this process shares its GPU with the worker beside it: ``mps`` where a CUDA MPS
    daemon's pipe directory is named (``CUDA_MPS_PIPE_DIRECTORY``, as the NVIDIA device plugin's
    MPS sharing sets it) or holds its pipes at the default place; else ``time slices``. Without
    MPS the GPU runs one process's work at a time, so a sidecar's copy waits for the worker's
    turn to end: 1.75 ms for a 2 MiB copy beside matrix products, 0.05 ms under MPS."""
    environ = os.environ if environ is None else environ
    named = environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if named:
        return "mps" if os.path.isdir(named) else "time slices"
    try:
        return "mps" if any(os.scandir(default)) else "time slices"
    except OSError:
        return "time slices"
