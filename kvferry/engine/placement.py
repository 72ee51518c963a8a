"""Where the daemon's threads run: next to its GPU; and how it shares that GPU (``gpu_sharing``).

On a host of several sockets, each GPU hangs off one NUMA node. A sidecar per GPU whose threads
wander to another node copies its staging buffers and its shared-memory writes across the
sockets' link, and its event loop wakes on a CPU whose caches hold nothing of it. So the daemon
pins every thread it has to the CPUs the kernel lists as local to its GPU's PCI device
(``local_cpulist``), within the CPUs it may use at all (its cgroup's cpuset, a ``taskset``):
what ``torchrun --numa-binding=node`` does for a training process. Threads made later inherit
it, and host memory first touched afterwards (pinned staging, the buffer pool) lands on that node.
"""

from __future__ import annotations

import os
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
