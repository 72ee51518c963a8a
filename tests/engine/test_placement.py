"""Where a daemon's threads run (``placement.py``): next to its GPU, within the CPUs it may use.

The CPU-list arithmetic and sysfs reading are checked on their own. Real daemons then check that
every thread is pinned as asked, that ``auto`` leaves a CPU daemon alone, and that a CPU list the
process may not use stops the daemon at start-up. Two daemons pinned apart (to CPUs of different
NUMA nodes where the host has several) then write each other's shared memory, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.demo import free_port
from kvferry.engine import Settings, placement
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop


def test_cpu_lists_parse_and_fold():
    assert placement.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert placement.parse_cpulist("\n") == set()
    assert placement.format_cpulist({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert placement.format_cpulist({5}) == "5" and placement.format_cpulist(set()) == ""
    for bad in ("x", "3-1", "1,,2", "-2", "1-"):
        with pytest.raises(ValueError):
            placement.parse_cpulist(bad)


@pytest.mark.parametrize("value", ["x", "3-1", "", "0-"])
def test_the_settings_refuse_what_is_neither_a_mode_nor_a_cpu_list(value):
    with pytest.raises(ValueError, match="cpu_affinity"):
        Settings(cpu_affinity=value).check()
    for good in ("auto", "off", "0", "0-15,32-47"):
        Settings(cpu_affinity=good).check()


def test_auto_takes_the_gpus_local_cpus_within_those_allowed():
    allowed = set(range(8))
    assert placement.choose("auto", allowed, set(range(4, 12))) == {4, 5, 6, 7}
    assert placement.choose("auto", allowed, None) is None  # no GPU, or sysfs does not say
    assert placement.choose("auto", {0, 1}, {2, 3}) is None  # none of them allowed: left alone
    assert placement.choose("auto", {0, 1}, {0, 1, 2}) is None  # all it may use anyway
    assert placement.choose("off", allowed, {0}) is None


def test_a_cpu_list_is_kept_within_those_allowed():
    assert placement.choose("1-3", {0, 1, 2}, None) == {1, 2}
    assert placement.choose("0-2", {0, 1, 2}, None) is None  # already so
    with pytest.raises(ValueError, match="none of 5-6"):
        placement.choose("5-6", {0, 1}, None)


def test_a_gpus_local_cpus_and_node_come_from_its_pci_device(tmp_path):
    device = tmp_path / "0000:1b:00.0"
    device.mkdir()
    (device / "local_cpulist").write_text("0-3,8\n")
    (device / "numa_node").write_text("1\n")
    assert placement.local_cpus("0000:1b:00.0", tmp_path) == ({0, 1, 2, 3, 8}, 1)
    (device / "numa_node").unlink()
    assert placement.local_cpus("0000:1b:00.0", tmp_path) == ({0, 1, 2, 3, 8}, -1)
    (device / "local_cpulist").write_text("\n")
    assert placement.local_cpus("0000:1b:00.0", tmp_path) is None
    assert placement.local_cpus("0000:99:00.0", tmp_path) is None


def test_auto_leaves_the_threads_alone_where_the_gpus_place_is_unknown(monkeypatch, tmp_path):
    """A torch without the PCI fields, or sysfs without the device: the daemon starts unpinned."""
    def no_address(index):
        raise AttributeError("'_CudaDeviceProperties' object has no attribute 'pci_bus_id'")

    before = os.sched_getaffinity(0)
    monkeypatch.setattr(placement, "gpu_pci_address", no_address)
    said = placement.pin("auto", 0)
    assert said.startswith("threads not pinned") and "no PCI address" in said
    monkeypatch.setattr(placement, "gpu_pci_address", lambda index: "0000:99:00.0")
    monkeypatch.setattr(placement, "SYSFS_PCI", tmp_path)
    said = placement.pin("auto", 0)
    assert said.startswith("threads not pinned") and "sysfs names no local CPUs" in said
    assert os.sched_getaffinity(0) == before


def _threads_cpus(pid: int) -> dict[str, set[int]]:
    """Each thread's allowed CPUs, from the kernel, by ``tid:name``."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = (task / "comm").read_text().strip()
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[f"{task.name}:{name}"] = placement.parse_cpulist(line.split(":", 1)[1])
    return found


def test_a_daemon_pins_every_thread_to_the_cpus_asked_for():
    cpu = max(os.sched_getaffinity(0))
    daemon = spawn(env={"KVFERRY_CPU_AFFINITY": str(cpu)})
    try:
        # A request makes the daemon work (and make worker threads) after it started.
        assert daemon.client.health()
        threads = _threads_cpus(daemon.process.pid)
        assert len(threads) > 1 and all(cpus == {cpu} for cpus in threads.values()), threads
    finally:
        stop(daemon)


def test_pinning_leaves_torch_no_more_threads_than_cpus():
    """OpenMP workers that outnumber their CPUs spin against each other: pinned to one CPU, the
    process runs one intra-op thread."""
    cpu = max(os.sched_getaffinity(0))
    script = ("import torch; from kvferry.engine import placement; torch.set_num_threads(8); "
              f"print(placement.pin({str(cpu)!r}, None)); print(torch.get_num_threads())")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    said, threads = run.stdout.strip().splitlines()
    assert run.returncode == 0 and threads == "1" and f"pinned to CPUs {cpu}" in said and "8 -> 1" in said, run


def test_auto_leaves_a_cpu_daemon_where_it_may_run():
    daemon = spawn()
    try:
        allowed = os.sched_getaffinity(0)
        threads = _threads_cpus(daemon.process.pid)
        assert all(cpus == allowed for cpus in threads.values()), threads
    finally:
        stop(daemon)


def test_a_cpu_list_the_daemon_may_not_use_stops_it_at_start():
    outside = max(os.sched_getaffinity(0)) + 1000
    command = [sys.executable, "-m", "kvferry.cli", "serve", "--port", str(free_port()), "--data-port",
               str(free_port()), "--device", "cpu"]
    run = subprocess.run(command, env={**os.environ, "KVFERRY_CPU_AFFINITY": str(outside)}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "cpu_affinity" in run.stderr and str(outside) in run.stderr


def _two_cpus_apart() -> tuple[int, int]:
    """Two CPUs this process may use, on different NUMA nodes where the host has several."""
    allowed = os.sched_getaffinity(0)
    nodes = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            cpus = placement.parse_cpulist((node / "cpulist").read_text()) & allowed
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(cpus)
    if len(nodes) >= 2:
        return min(nodes[0]), min(nodes[1])
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin apart")
    first, second = sorted(allowed)[:2]
    return first, second


def test_daemons_pinned_apart_write_each_others_shared_memory(kv):
    """A sidecar per GPU on a two-socket host: each pinned to its own node, writing the other's
    lent shared memory (a standing lease) with its own CPUs, bit for bit."""
    blocks = 48
    source = kv[:blocks].contiguous()
    first, second = _two_cpus_apart()
    env = {"KVFERRY_TRANSFER_TIMEOUT": "20"}
    a = spawn(env={**env, "KVFERRY_CPU_AFFINITY": str(first)})
    b = spawn(env={**env, "KVFERRY_CPU_AFFINITY": str(second)})
    segments = []
    try:
        for daemon, cpu in ((a, first), (b, second)):
            threads = _threads_cpus(daemon.process.pid)
            assert all(cpus == {cpu} for cpus in threads.values()), threads
        segments.append(a.client.region_from_tensor("src", source, kind="shm")[1])
        segments.append(b.client.region_from_tensor("dst", torch.zeros_like(source), kind="shm")[1])
        landed = torch.frombuffer(segments[1].buf, dtype=source.dtype).view(source.shape)
        order = list(range(blocks - 1, -1, -1))
        whole = a.client.wait(a.client.submit("src", range(blocks), b.data, "dst", order, codec="raw"), timeout=60)
        assert whole["state"] == "done" and bits_equal(landed[order], source)
        for i in range(8):  # written straight into the lent memory under the lease the first one took
            src_ids, dst_ids = [i, 40 + i], [3 * i + 1, blocks - 1 - i]
            landed[dst_ids] = 0
            record = a.client.wait(a.client.submit("src", src_ids, b.data, "dst", dst_ids, codec="raw"), timeout=30)
            assert record["state"] == "done" and "same host" in record["choice_reason"], record
            assert bits_equal(landed[dst_ids], source[src_ids])
    finally:
        stop(a, b)
        for segment in segments:
            segment.close()
            segment.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_pins_a_gpu_daemon_next_to_its_gpu():
    """On the last GPU (the far node on a host of several): its threads run on the CPUs sysfs
    lists for that GPU, within those allowed, or stay where they were where that changes nothing."""
    index = torch.cuda.device_count() - 1
    found = placement.local_cpus(placement.gpu_pci_address(index))
    allowed = os.sched_getaffinity(0)
    expected = placement.choose("auto", allowed, found[0] if found else None) or allowed
    daemon = spawn(device=f"cuda:{index}")
    try:
        threads = _threads_cpus(daemon.process.pid)
        assert all(cpus == expected for cpus in threads.values()), threads
    finally:
        stop(daemon)


def test_gpu_sharing_is_mps_only_where_a_daemons_pipe_directory_is(tmp_path):
    from kvferry.engine.placement import gpu_sharing

    named = tmp_path / "mps"
    assert gpu_sharing({"CUDA_MPS_PIPE_DIRECTORY": str(named)}, default=str(tmp_path / "none")) == "time slices"
    named.mkdir()
    assert gpu_sharing({"CUDA_MPS_PIPE_DIRECTORY": str(named)}, default=str(tmp_path / "none")) == "mps"
    default = tmp_path / "default"
    assert gpu_sharing({}, default=str(default)) == "time slices"  # no directory
    default.mkdir()
    assert gpu_sharing({}, default=str(default)) == "time slices"  # no daemon's pipes in it
    (default / "control").touch()
    assert gpu_sharing({}, default=str(default)) == "mps"


def test_a_cpu_sidecar_reports_that_it_shares_no_gpu():
    """``kvferry_build_info`` says how the sidecar shares its GPU; on the CPU, none."""
    import asyncio

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvferry.engine import Engine, Settings

    async def main():
        engine = Engine(Settings(data_port=0, device="cpu", transport_backend="tcp"))
        await engine.start()
        try:
            text = generate_latest(engine.metrics.registry).decode()
        finally:
            await engine.close()
        return {s.labels.get("gpu_sharing") for f in text_string_to_metric_families(text) for s in f.samples
                if f.name == "kvferry_build_info"}

    assert asyncio.run(main()) == {"none"}
