"""``kvferry calibrate --codec lowrank`` through the real command line, on the shipped KV sample."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvferry.codec import lowrank
from kvferry.codec.layout import BlockLayout
from tests.codec.test_lowrank import AXES, as_blocks, kv_chunk

SAMPLE = Path(__file__).parents[1] / "data" / "kv_smollm2_gpl3.npz"


def kvferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from kvferry.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])


def test_calibrate_by_energy_matches_the_library(tmp_path, real_kv):
    out = tmp_path / "book.json"
    done = kvferry("calibrate", "--codec", "lowrank", "--energy", "0.95", "--axes", "head,token,channel",
                   "--select", "^c0_", str(SAMPLE), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "mean rank" in done.stdout and "energy 0.95" in done.stdout
    book = lowrank.LowRankCodebook.from_json(out.read_text())
    assert book.dims == (30, 2, 3, 64) and book.axes == AXES
    assert book.to_json() == lowrank.calibrate(kv_chunk(real_kv, 0), axes=AXES, energy=0.95).to_json()
    x = as_blocks(kv_chunk(real_kv, 1), 73)
    bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
    assert lowrank.decode(lowrank.encode(x, bound), bound).shape == x.shape


def test_calibrate_by_rank_budget_with_k8v4(tmp_path):
    out = tmp_path / "book.json"
    done = kvferry("calibrate", "--codec", "lowrank", "--rank-budget", "2000", "--quantize", "k8v4",
                   "--axes", "head,token,channel", str(SAMPLE), "-o", str(out))
    assert done.returncode == 0, done.stderr
    book = lowrank.LowRankCodebook.from_json(out.read_text())
    assert int(book.ranks.sum()) == 2000 and book.quantize == "k8v4" and book.samples == 2 * 511


def test_calibrate_refusals_are_clean_errors(tmp_path):
    out = tmp_path / "book.json"
    bad_axes = kvferry("calibrate", "--codec", "lowrank", "--axes", "head,token", str(SAMPLE), "-o", str(out))
    assert bad_axes.returncode == 2 and "kvferry calibrate:" in bad_axes.stderr and not out.exists()
    other = kvferry("calibrate", "--codec", "splitzip", "--energy", "0.9", str(SAMPLE), "-o", str(out))
    assert other.returncode == 2 and "does not take energy" in other.stderr
