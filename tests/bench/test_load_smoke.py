"""bench/load.py at a tiny size: real sidecars, several transfers in flight into one receiver (and
from one sender into two), every transfer done and compared bit for bit, and the JSON's counts add
up. It checks the benchmark's behaviour, never a speed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("topology, layout, codecs", [(["--senders", "2"], "mirror", "auto"),
                                                     (["--receivers", "2"], "spread", "raw")])
def test_load_moves_every_transfer_bit_exact(tmp_path, topology, layout, codecs):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), *topology, "--inflight", "4",
                          "--transfers", "12", "--warmup", "4", "--layers", "2", "--tokens", "128", "--layout", layout,
                          "--codecs", codecs, "--check-every", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["blocks_per_request"] == 8  # 128 tokens in blocks of 16
    assert report["request_bytes"] == 8 * 2 * 2 * 16 * 8 * 128 * 2  # blocks, layers, K/V, tokens, heads, dim, bf16
    assert [p["codec"] for p in report["phases"]] == codecs.split(",")
    own_hosts = os.geteuid() == 0 and shutil.which("unshare") is not None
    sidecars = {"s0", "s1", "r0"} if topology[0] == "--senders" else {"s0", "r0", "r1"}
    for phase in report["phases"]:
        assert phase["failed"] == 0 and phase["failures"] == [], phase["failures"]
        assert phase["issued"] == phase["done"] + phase["failed"] == 12
        assert phase["checked"] == 12 and phase["mismatched"] == 0
        if own_hosts:  # each sidecar under its own hostname: no same-host shortcut, the bytes crossed sockets
            assert phase["crossed_wire"]
        assert sum(phase["chosen"].values()) == 12
        assert phase["bytes_raw"] == 12 * report["request_bytes"]
        assert phase["bytes_wire"] > 0
        assert 0 < phase["p50_ms"] <= phase["p99_ms"] <= phase["max_ms"]
        assert phase["transfers_per_s"] > 0 and phase["gb_per_s"] > 0
        assert set(phase["rss_start"]) == set(phase["rss_end"]) == sidecars
        assert all(v > 0 for v in phase["rss_end"].values())
        assert phase["sender_cpu_s_per_gb"] is not None and phase["receiver_cpu_s_per_gb"] is not None
        pairs = phase["per_pair_p50_ms"]
        assert set(pairs) == ({"s0->r0", "s1->r0"} if topology[0] == "--senders" else {"s0->r0", "s0->r1"})
    assert "12 done 0 failed" in run.stdout
