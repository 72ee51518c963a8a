"""Every metric the Grafana dashboard queries exists in a real daemon's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.conftest import spawn, stop

ROOT = Path(__file__).parents[2]
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")


def _queried_metrics() -> set[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kvferry.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in re.findall(r"\bkvferry_[a-z0-9_]+", expr)}


@pytest.mark.slow
def test_dashboard_metrics_exist():
    daemon = spawn("tcp")
    try:
        text = daemon.client.metrics()
    finally:
        stop(daemon)
    families = {f.name for f in text_string_to_metric_families(text)}
    samples = set(re.findall(r"^(kvferry_[a-z0-9_]+)", text, re.M))
    queried = _queried_metrics()
    assert len(queried) >= 10
    for name in queried:
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
        assert name in samples or base in families, f"dashboard queries {name}, the daemon does not export it"
    panels = {p["title"] for p in json.loads((ROOT / "deploy" / "grafana" / "kvferry.json").read_text())["panels"]}
    assert {"Transfer latency quantiles", "Errors by kind", "Transfers by state", "In flight"} <= panels
