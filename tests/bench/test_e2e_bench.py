"""bench/e2e.py on a CPU: real sidecars, a real sweep, the analysis it prints. Small sizes, so
it checks that the benchmark works and measures what it says, not how fast anything is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "e2e.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("e2e_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_sweep_on_a_cpu_moves_exact_bytes_and_honours_the_link(tmp_path):
    out = tmp_path / "e2e.json"
    link_gbps = 0.01  # 10 MB/s: four 64 KiB blocks need at least 26 ms on the wire
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "32,64", "--links", f"{link_gbps},max", "--layers", "1",
         "--repeats", "1", "--backend", "tcp", "--out", str(out), "--plot", str(tmp_path / "e2e.png")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    points = report["points"]
    assert len(points) == 2 * 2 * 3
    assert all(p["exact"] and p["error"] is None for p in points)
    by = {(p["link"], p["tokens"], p["codec"]): p for p in points}
    raw = by[(str(link_gbps), 64, "raw")]
    assert raw["bytes_raw"] == 4 * 64 * 1024 == raw["bytes_wire"] - 160  # one chunk: one stored frame's header
    assert raw["median_s"] >= raw["bytes_raw"] / (link_gbps * 1e9)
    assert by[(str(link_gbps), 64, "splitzip")]["bytes_raw"] / by[(str(link_gbps), 64, "splitzip")]["bytes_wire"] > 1.2
    assert "| link GB/s | tokens |" in run.stdout and "targets:" in run.stdout


def test_analysis_speedup_model_and_targets():
    bench = _load_bench()
    gib = 1 << 30
    report = {"codec": {"encode_gbps": 400.0, "decode_gbps": 400.0}, "points": [
        {"link": "100", "tokens": 8192, "codec": "raw", "chosen": "raw", "bytes_raw": gib, "bytes_wire": gib,
         "median_s": 0.0110, "seconds": [0.0110]},
        {"link": "100", "tokens": 8192, "codec": "splitzip", "chosen": "splitzip", "bytes_raw": gib,
         "bytes_wire": int(gib / 1.33), "median_s": 0.0090, "seconds": [0.0090]},
        {"link": "100", "tokens": 8192, "codec": "auto", "chosen": "splitzip", "bytes_raw": gib,
         "bytes_wire": int(gib / 1.33), "median_s": 0.0093, "seconds": [0.0093]},
    ]}
    rows = {r["codec"]: r for r in bench.analyse(report)}
    assert abs(rows["splitzip"]["speedup"] - 0.0110 / 0.0090) < 1e-9
    assert rows["splitzip"]["target"] is False  # 1.222 < 0.95 * 1.33
    assert rows["auto"]["target"] is False  # 3.3% slower than splitzip
    expected = max(gib / 400e9, gib / (1.33 * 100e9), gib / 400e9)
    assert abs(rows["splitzip"]["model_s"] - expected) / expected < 1e-3
    assert rows["raw"]["model_s"] == gib / 100e9


def test_emulated_links_run_over_a_transport_faster_than_them(monkeypatch):
    """Between GPUs ``auto`` puts the links on ucxx (CUDA IPC), not the sidecars' own choice
    without RDMA (TCP lanes, slower than the links emulated); a named backend is kept."""
    bench = _load_bench()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "ucxx" else real(name, *a))
    assert bench.link_backend("auto", "cuda:0") == "ucxx"
    assert bench.link_backend("auto", "cpu") == "tcp"
    assert bench.link_backend("tcp", "cuda:0") == "tcp"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a))
    assert bench.link_backend("auto", "cuda:0") == "tcp"
