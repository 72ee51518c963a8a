"""The layers hold (import-linter, configured in pyproject): cli > demo > api | client > engine > codec | transport > proto, the generated protocol code (kvferry.proto) imports nothing else of kvferry, the client SDK imports no server code, no production module imports kvferry.testing, and the transport base imports no backend (backends import only the base)."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_layers_contract():
    lint = str(Path(sysconfig.get_path("scripts")) / "lint-imports")
    result = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout
