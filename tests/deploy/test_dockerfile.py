"""The image: hadolint-clean, and its entrypoint, ports and health check match the daemon."""

from __future__ import annotations

import json
import re
import subprocess
import sysconfig
from pathlib import Path

from kvferry.engine.settings import Settings

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SCRIPTS = Path(sysconfig.get_path("scripts"))


def test_hadolint_has_no_findings():
    result = subprocess.run([str(SCRIPTS / "hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_ports_and_healthcheck_match_the_cli():
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE, re.M).group(1))
    assert entrypoint == ["kvferry", "serve"]
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()}
    defaults = Settings()
    assert exposed == {defaults.port, defaults.data_port}
    assert f"127.0.0.1:{defaults.port}/healthz" in DOCKERFILE
    assert re.search(r"^USER 10001$", DOCKERFILE, re.M)
    help_text = subprocess.run([str(SCRIPTS / "kvferry"), "serve", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "--data-port" in help_text.stdout


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
