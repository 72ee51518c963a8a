"""The installed ``kvferry`` console script: calibrate and codec-demo, as a user runs them."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

from kvferry import codec
from tests.conftest import KV_SAMPLE

# The console script the package installed beside this interpreter, not whatever PATH holds.
KVFERRY = str(Path(sysconfig.get_path("scripts")) / "kvferry")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVFERRY, *args], capture_output=True, text=True, timeout=300)


def test_help_is_fast_and_lists_commands():
    result = run("--help")
    assert result.returncode == 0
    assert "calibrate" in result.stdout and "codec-demo" in result.stdout


def test_calibrate_k_only(tmp_path):
    out = tmp_path / "k.json"
    result = run("calibrate", str(KV_SAMPLE), "--select", "^c0_.*_k$", "-o", str(out))
    assert result.returncode == 0, result.stderr
    book = codec.Codebook.from_json(out.read_text())
    assert book.dtype == "bfloat16" and book.samples == 30 * 3 * 511 * 64
    assert book.coverage > 0.999


def test_calibrate_no_match(tmp_path):
    result = run("calibrate", str(KV_SAMPLE), "--select", "nothing", "-o", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "no arrays" in result.stderr


def test_codec_demo_reports_bit_exact(tmp_path):
    result = run("codec-demo", "--data", str(KV_SAMPLE))
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines() if l.startswith(("bfloat16", "float"))]
    assert len(lines) == 4 and all(l.endswith("yes") for l in lines)
    assert float(lines[0].split()[2]) >= 1.32
