"""bench/exchange_floor.py on a CPU: two real processes, a real socket, sealed messages whose tags
are checked. It checks that the benchmark runs and lands the block, not how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_floor_exchange_lands_the_block_and_reports_it(tmp_path):
    out = tmp_path / "floor.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "exchange_floor.py"), "--device", "cpu",
                          "--block-kib", "4", "--n", "20", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["bit_exact"] is True and result["n"] == 20 and result["block_bytes"] == 4096
    assert 0 < result["median_ms"] <= result["p90_ms"]
    assert "exchange floor, one 4 KiB block, host memory" in run.stdout
