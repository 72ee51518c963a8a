"""``bench/peers.py --netns`` end to end at a small size: kvferry's rows come from sidecars on two
hosts joined by a shaped veth (no loopback, no pacing, no model), every transfer crossed the cable
(the script fails otherwise) and is bit-exact, plain sockets measure the cable first, and the table
says the link. It checks the
benchmark works, not how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_peers_over_a_real_link(tmp_path):
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--device", "cpu", "--backend", "tcp",
                          "--netns", "0.5", "--sizes", "2M,6M", "--codecs", "raw,auto", "--repeats", "1",
                          "--small-repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    timed = [r for r in rows if r["system"] == "kvferry" and not r["how"].endswith(", at the receiver")]
    assert [(r["how"].split()[0], r["blocks"]) for r in timed] == [("raw", 1), ("raw", 3), ("auto", 1), ("auto", 3)]
    assert all(r["netns_gbit"] == 0.5 and r["link_gbps"] == 0 and r["bit_exact"] for r in rows)
    assert all(r["median_s"] > 0 and r["p99_s"] >= r["median_s"] for r in rows)
    # 6 MiB of raw KV at 0.5 Gbit/s: at least its time on the cable (the shaping is real)
    raw6 = next(r for r in timed if r["how"] == "raw" and r["blocks"] == 3)
    assert raw6["median_s"] >= 0.9 * raw6["bytes"] * 8 / 0.5e9, raw6
    assert "| kvferry | raw | 0.5 Gbit/s veth | 6 MiB |" in run.stdout
    assert "modelled" not in run.stdout
    # the cable's roofline: plain sockets, one stream and four, no faster than the shaper lets them
    sockets = [r for r in rows if r["system"] == "sockets"]
    assert [r["how"].split(", ")[1] for r in sockets] == ["1 stream", "4 streams"]
    assert all(r["blocks"] == 3 and r["median_s"] >= 0.9 * r["bytes"] * 8 / 0.5e9 for r in sockets), sockets
    assert "| sockets | raw TCP, 1 stream, host memory | 0.5 Gbit/s veth | 6 MiB |" in run.stdout
