"""bench/peers.py on a CPU without NIXL (what CI can run): two real sidecars move Llama-3-8B-shaped
blocks of real KV with every codec, the sampled destination blocks are compared bit for bit, and
the table and JSON say what was moved. It checks the benchmark works, not how fast anything is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_peers_on_a_cpu_without_nixl(tmp_path):
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--device", "cpu", "--backend", "tcp",
                          "--no-nixl", "--sizes", "2M,6M", "--repeats", "1", "--small-repeats", "3", "--links", "0.05",
                          "--link-min-bytes", "6M", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    every = report["rows"]
    # The sidecars' event loop is on record: uvicorn runs uvloop wherever it imports.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    assert report["event_loop"].startswith(loop) and f"sidecars on {report['event_loop']}" in run.stdout
    rows = [r for r in every if not r["how"].endswith(", at the receiver")]  # submit to the sender's done
    at_receiver = [r for r in every if r["how"].endswith(", at the receiver")]  # to the receiver's own done
    assert [(r["how"].removesuffix(", at the receiver"), r["blocks"]) for r in at_receiver] == [
        (r["how"], r["blocks"]) for r in rows]
    assert all(r["median_s"] > 0 for r in at_receiver)
    assert [(r["how"].split()[0], r["blocks"], r["link_gbps"]) for r in rows] == [
        (codec, blocks, 0.0) for codec in ("raw", "splitzip", "auto") for blocks in (1, 3)] + [
        (codec, 3, 0.05) for codec in ("raw", "splitzip", "auto")]
    assert all(r["bit_exact"] and r["median_s"] > 0 for r in rows)
    assert all(r["ratio"] > 1.2 for r in rows if r["how"] == "splitzip")  # real KV compresses
    # auto's row names what it chose ("auto (splitzip)"), which a slow link may change: keyed by codec
    unpaced = {r["how"].split()[0]: r for r in rows[:6] if r["blocks"] == 3}
    for row in rows[6:]:  # paced: the same blocks moved, the same bytes, the codec's ratio unchanged
        assert row["bytes"] == unpaced[row["how"].split()[0]]["bytes"], row
        if row["how"] == "splitzip":
            assert row["ratio"] == pytest.approx(unpaced["splitzip"]["ratio"], rel=0.05), row
    assert "| kvferry | splitzip | unpaced | 6 MiB |" in run.stdout and "| 0.05 GB/s | 6 MiB |" in run.stdout
