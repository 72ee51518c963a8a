"""bench/message_cost.py runs against a real engine and a raw peer, and every family of hostile
messages reaches the handler (its times are the benchmark's to report, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_family_is_measured(tmp_path):
    out = tmp_path / "cost.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "message_cost.py"), "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report) == 10
    assert all(family["messages"] >= 5 and family["worst_ms"] >= family["median_ms"] > 0 for family in report.values())
