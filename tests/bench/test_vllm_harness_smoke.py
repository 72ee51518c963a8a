"""bench/vllm_gpu_harness.py runs on a CPU at a tiny size with both control paths in one run: every
request's KV arrives bit for bit, the grpc path's ends all come by the Watch stream, and each path
is reported (its times are the benchmark's to report, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_both_control_paths_in_one_run(tmp_path):
    pytest.importorskip("grpc", reason="the grpc path needs the grpc extra")
    out = tmp_path / "harness.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_gpu_harness.py"), "--devices", "cpu,cpu",
                          "--tokens", "32", "--requests", "2", "--control", "http,grpc", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"http", "grpc"} == set(report["summary"])
    for control, rows in report["rows"].items():
        assert len(rows) == 2 and all(r["bit_exact"] for r in rows)
        assert all(r["control"] == control for r in rows)
        summary = report["summary"][control]
        for key in ("wait", "transfer", "overhead", "reply"):
            assert summary[key]["p90_ms"] >= summary[key]["median_ms"]
    assert "| grpc |" in run.stdout and "| http |" in run.stdout


@pytest.mark.parametrize("devices", ["cpu", "cpu,cuda:0", "cuda:0,cuda:1,cuda:2"])
def test_devices_are_two_of_one_kind(devices):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_gpu_harness.py"), "--devices", devices],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--devices" in run.stderr and "two devices of one kind" in run.stderr, run.stderr
