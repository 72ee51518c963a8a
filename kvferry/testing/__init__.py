"""Test and benchmark scaffolding shipped with the package so tests and ``bench/`` share it (and a
GPU host running from the wheel has it too). Production code never imports it: import-linter
forbids every other ``kvferry`` package from doing so (pyproject.toml)."""
