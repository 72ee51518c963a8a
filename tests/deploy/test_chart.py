"""The Helm chart, linted and rendered by the real Helm engine (helm-python-sdk embeds Helm v4),
manifests validated against the Kubernetes schemas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from kvferry.engine.settings import Settings

ROOT = Path(__file__).parents[2]
CHART = ROOT / "deploy" / "helm" / "kvferry"
ALL_OPTIONS = yaml.safe_load((ROOT / "deploy" / "helm" / "ci" / "all-options.yaml").read_text())
KUBE_VERSION = "1.33.0"
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
VALUES = {"default": {}, "all-options": ALL_OPTIONS}


def render(values: dict) -> list[dict]:
    chart = helm_python.Chart.load(str(CHART))
    try:
        rendered = chart.render(values, name="test", namespace="serving")
    finally:
        chart.close()
    documents = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            documents += [doc for doc in yaml.safe_load_all(text) if doc]
    return documents


@pytest.mark.parametrize("name", VALUES)
def test_lint_clean(name):
    report = helm_python.lint(str(CHART), VALUES[name], strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", VALUES)
def test_manifests_validate_against_kubernetes_schemas(name):
    documents = render(VALUES[name])
    kinds = {doc["kind"] for doc in documents}
    assert {"Deployment", "Service"} <= kinds
    if name == "all-options":
        assert {"Secret", "NetworkPolicy", "ServiceMonitor", "PodMonitor"} <= kinds
    for doc in documents:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            endpoints = doc["spec"].get("endpoints") or doc["spec"]["podMetricsEndpoints"]
            assert endpoints[0]["path"] == "/metrics" and endpoints[0]["port"] == "control"
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _sidecar(values: dict) -> dict:
    deployment = next(d for d in render(values) if d["kind"] == "Deployment")
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"worker", "kvferry"}
    return containers["kvferry"]


def test_sidecar_ports_probes_and_settings_match_the_daemon():
    sidecar = _sidecar({})
    defaults = Settings()
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"control": defaults.port, "data": defaults.data_port}
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e for e in sidecar["env"]}
    fields = {f.name for f in dataclasses.fields(Settings)}
    for key, value in yaml.safe_load((CHART / "values.yaml").read_text())["config"].items():
        assert key in fields, f"values.config.{key} is not a daemon setting"
        assert env[f"KVFERRY_{key.upper()}"]["value"] == str(value)  # one-to-one, no float formatting
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    # Listening on the pod's address takes both secrets, which the chart creates by default.
    assert sidecar["args"][:2] == ["--host", "0.0.0.0"] and "--data-host" in sidecar["args"]
    assert env["KVFERRY_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
    assert env["KVFERRY_PEER_SECRET"]["valueFrom"]["secretKeyRef"]["key"] == "peer-secret"
    secrets = {d["metadata"]["name"]: d for d in render({}) if d["kind"] == "Secret"}
    assert set(secrets) == {"test-kvferry-token", "test-kvferry-peer"}
    assert all(len(s["data"][k]) >= 40 for s in secrets.values() for k in s["data"])


def test_no_secret_no_listener():
    chart = helm_python.Chart.load(str(CHART))
    try:
        for values in ({"token": {"create": False}}, {"peerSecret": {"create": False}}):
            with pytest.raises(helm_python.HelmError, match="secret|Secret"):
                chart.render(values, name="test")
    finally:
        chart.close()


def test_all_options_turn_on_rdma_token_and_ucx():
    sidecar = _sidecar(ALL_OPTIONS)
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["KVFERRY_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
    assert [e["name"] for e in sidecar["env"]].count("KVFERRY_TOKEN") == 1
    assert env["KVFERRY_PEER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "kv-peers"
    assert env["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc,tcp" and env["UCX_RNDV_THRESH"]["value"] == "8k"
    assert env["KVFERRY_TRANSFER_TIMEOUT"]["value"] == "12.5"
    assert "IPC_LOCK" in sidecar["securityContext"]["capabilities"]["add"]
    assert sidecar["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1


def test_schema_rejects_bad_values():
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmError):
            chart.render({"ports": {"control": "http"}}, name="test")
        with pytest.raises(helm_python.HelmError):
            chart.render({"config": {"transport_backend": "carrier-pigeon"}}, name="test")
    finally:
        chart.close()


def test_named_template_is_includable_from_another_chart(tmp_path):
    """A user's own chart pulls the sidecar in with include "kvferry.sidecar"."""
    user = tmp_path / "worker"
    (user / "templates").mkdir(parents=True)
    (user / "charts").mkdir()
    (user / "Chart.yaml").write_text("apiVersion: v2\nname: worker\nversion: 1.0.0\n"
                                     "dependencies:\n  - name: kvferry\n    version: 0.1.0\n")
    import shutil

    shutil.copytree(CHART, user / "charts" / "kvferry")
    (user / "templates" / "pod.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: worker}\nspec:\n  containers:\n"
        "    - {name: engine, image: my/engine:1}\n"
        '    {{- include "kvferry.sidecar" .Subcharts.kvferry | nindent 4 }}\n'
        "  volumes:\n    - {name: dshm, emptyDir: {medium: Memory}}\n    - {name: kvferry-tmp, emptyDir: {}}\n")
    chart = helm_python.Chart.load(str(user))
    try:
        rendered = chart.render({"kvferry": {"example": {"enabled": False}}}, name="w")
    finally:
        chart.close()
    pod = yaml.safe_load(rendered["worker/templates/pod.yaml"])
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine", "kvferry"]
