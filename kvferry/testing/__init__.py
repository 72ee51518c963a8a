"""Test and benchmark scaffolding shipped with the package so tests and ``bench/`` share it (and a
GPU host running from the wheel has it too): ``netns`` (real networks on one machine), ``faults``
and its entry point ``serve`` (sidecars with injected faults). Production code never imports it:
import-linter forbids every other ``kvferry`` package from doing so (pyproject.toml)."""
