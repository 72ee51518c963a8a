"""codec and transport never import each other or service (import-linter, configured in pyproject)."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_layers_contract():
    lint = str(Path(sysconfig.get_path("scripts")) / "lint-imports")
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout
