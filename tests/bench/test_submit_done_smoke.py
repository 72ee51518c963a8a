"""bench/submit_done.py runs against two real sidecars serving REST and gRPC, every way of learning
a small transfer's end is measured in the same run, and each transfer ended done (the times are
the benchmark's to report, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_http_and_grpc_in_one_run(tmp_path):
    pytest.importorskip("grpc", reason="the gRPC ways need the grpc extra")
    out = tmp_path / "submit.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "submit_done.py"), "--n", "20", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and {name.split(",")[0] for name in rows} == {"HTTP", "gRPC"}
    assert any("SubmitAndWatch" in name for name in rows) and any("GrpcSender.send" in name for name in rows)
    assert all(row["n"] == 18 and row["p99_us"] >= row["median_us"] > 0 for row in rows.values())
