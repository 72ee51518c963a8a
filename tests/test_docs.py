"""The documentation's code runs as written.

A fenced block whose info string is ``python runnable`` is a complete program: it runs in a fresh
interpreter and must exit 0. ``python runnable sidecars`` additionally needs the two sidecars the
text tells the reader to start (``kvferry serve --port 7700 --data-port 7701`` and ``--port 7710
--data-port 7711``); the test starts them as real processes first, on those ports, or on free
ones (the block's URLs rewritten to match) where another process holds them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.client import Client
from kvferry.demo import free_port, start_sidecar, stop_sidecars, wait_ready

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python runnable(?P<tags>[^\n]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
SIDECAR_PORTS = ((7700, 7701), (7710, 7711))


def blocks() -> list[tuple[str, set[str], str]]:
    found = []
    for path in DOCS:
        for match in FENCE.finditer(path.read_text()):
            line = path.read_text().count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", set(match["tags"].split()), match["code"]))
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_readme_has_runnable_blocks() -> None:
    readme = [name for name, _, _ in blocks() if name.startswith("README.md")]
    assert len(readme) >= 2, "the README's examples are no longer tagged `python runnable`"


@pytest.mark.parametrize("name,tags,code", blocks(), ids=[name for name, _, _ in blocks()])
def test_block_runs_as_written(name: str, tags: set[str], code: str) -> None:
    unknown = tags - {"sidecars"}
    assert not unknown, f"{name}: unknown tags {unknown}"
    processes = []
    try:
        if "sidecars" in tags:
            for port, data_port in SIDECAR_PORTS:
                if _free(port) and _free(data_port):
                    actual, actual_data = port, data_port
                else:
                    actual, actual_data = free_port(), free_port()
                    code = code.replace(f"127.0.0.1:{port}", f"127.0.0.1:{actual}")
                process = start_sidecar(actual, actual_data, "tcp")
                processes.append(process)
                wait_ready(Client(f"http://127.0.0.1:{actual}"), process)
        result = _run(code)
        assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    finally:
        stop_sidecars(processes)


def test_a_broken_block_fails() -> None:
    """The runner reports a failing block (so a passing run means the blocks ran)."""
    assert _run("raise SystemExit(3)").returncode == 3
    assert _run("assert 1 == 2").returncode != 0


LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve() -> None:
    """Every relative link of the README and docs names a file or folder of the repository."""
    broken = []
    for path in DOCS:
        for match in LINK.finditer(path.read_text()):
            target = match["target"]
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken
