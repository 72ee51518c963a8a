"""The Helm chart, linted and rendered by the real Helm engine (helm-python-sdk embeds Helm v4),
manifests validated against the Kubernetes schemas."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from kvferry.engine import settings
from kvferry.engine.settings import Settings

ROOT = Path(__file__).parents[2]
CHART = ROOT / "deploy" / "helm" / "kvferry"
ALL_OPTIONS = yaml.safe_load((ROOT / "deploy" / "helm" / "ci" / "all-options.yaml").read_text())
KUBE_VERSION = "1.33.0"
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
# The prefill/decode vLLM deployment of README's "Deploying", NetworkPolicy on.
VLLM = {"example": {"enabled": False}, "networkPolicy": {"enabled": True},
        "vllm": {"model": "Qwen/Qwen3-8B", "prefill": {"enabled": True}, "decode": {"enabled": True}}}
VALUES = {"default": {}, "all-options": ALL_OPTIONS, "vllm": VLLM}


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
    deployment = _deployments(render(values))["example"]
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
    config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    for key, value in config.items():
        assert key in fields, f"values.config.{key} is not a daemon setting"
        rendered = env[f"KVFERRY_{key.upper()}"]["value"]
        assert rendered == (str(value).lower() if isinstance(value, bool) else str(value))  # no float formatting
    read = settings.load(cli={}, environ={f"KVFERRY_{k.upper()}": env[f"KVFERRY_{k.upper()}"]["value"] for k in config})
    assert {k: getattr(read, k) for k in config} == config  # the daemon reads each as the chart means it
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


def test_mps_pipe_directory_reaches_every_gpu_container_where_it_is_set():
    """The MPS daemon's pipe directory, from the node into the sidecar and both vLLM containers,
    with CUDA_MPS_PIPE_DIRECTORY pointing there; nothing of it where it is not set."""
    def gpu_containers(documents):
        return [(doc, c) for doc in documents if doc["kind"] == "Deployment"
                for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] in ("kvferry", "vllm")]

    on = dict(VLLM, mps={"pipeDirectory": "/run/nvidia-mps"})
    found = gpu_containers(render(on))
    assert {c["name"] for _, c in found} == {"kvferry", "vllm"} and len(found) == 4  # two roles
    for doc, container in found:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps", container["name"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kvferry-mps"] == "/run/nvidia-mps"
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        assert volumes["kvferry-mps"]["hostPath"] == {"path": "/run/nvidia-mps", "type": "Directory"}
    for doc, container in gpu_containers(render(VLLM)):
        assert "CUDA_MPS_PIPE_DIRECTORY" not in {e["name"] for e in container["env"]}
        assert "kvferry-mps" not in {v["name"] for v in doc["spec"]["template"]["spec"]["volumes"]}
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmError):
            chart.render({"mps": {"pipeDirectory": "relative/dir"}}, name="test", namespace="serving")
    finally:
        chart.close()


def test_the_grpc_port_is_exposed_where_it_is_on():
    off = _sidecar({})
    assert "--grpc-port" not in off["args"] and "grpc" not in {p["name"] for p in off["ports"]}
    documents = render(ALL_OPTIONS)
    on = _sidecar(ALL_OPTIONS)
    port = ALL_OPTIONS["ports"]["grpc"]
    assert on["args"][on["args"].index("--grpc-port") + 1] == str(port)
    assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in on["ports"]
    service = _of_kind(documents, "Service")["test-kvferry"]
    assert {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"} in service["spec"]["ports"]
    policy = _of_kind(documents, "NetworkPolicy")["test-kvferry"]
    control = [r for r in policy["spec"]["ingress"] if {"port": ALL_OPTIONS["ports"]["control"], "protocol": "TCP"}
               in r["ports"]]
    assert len(control) == 1 and {"port": port, "protocol": "TCP"} in control[0]["ports"]  # the same clients


def test_schema_rejects_bad_values():
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmError):
            chart.render({"ports": {"control": "http"}}, name="test")
        with pytest.raises(helm_python.HelmError):
            chart.render({"config": {"transport_backend": "carrier-pigeon"}}, name="test")
    finally:
        chart.close()


# ---- helpers: pods, selectors, volumes --------------------------------------------------------
def _deployments(documents: list[dict]) -> dict[str, dict]:
    """Deployments by component (example, prefill, decode, proxy)."""
    found = {}
    for doc in documents:
        if doc["kind"] == "Deployment":
            found[doc["metadata"]["labels"].get("app.kubernetes.io/component", doc["metadata"]["name"])] = doc
    return found


def _of_kind(documents: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels/matchExpressions, or a Service's plain map) against labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _assert_pod_is_whole(pod: dict) -> None:
    """Every volumeMount names a volume of the pod (once), every container name is unique, and
    the sidecar shares /dev/shm (an in-memory emptyDir) and the process namespace with the worker."""
    volumes = [v["name"] for v in pod.get("volumes", [])]
    assert len(volumes) == len(set(volumes)), volumes
    names = [c["name"] for c in pod.get("initContainers", []) + pod["containers"]]
    assert len(names) == len(set(names)), names
    for container in _containers(pod).values():
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{container['name']} mounts {mount['name']}, not a volume of its pod"
    containers = {c["name"]: c for c in pod["containers"]}
    if "kvferry" in containers:
        assert pod["shareProcessNamespace"] is True  # CUDA IPC handles between the worker's and the sidecar's processes
        shm = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
        assert len(shm) == 1 and all(any(m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts", []))
                                     for c in pod["containers"]), "worker and sidecar share one /dev/shm"
        volume = next(v for v in pod["volumes"] if v["name"] in shm)
        assert volume["emptyDir"]["medium"] == "Memory"


def _kv_transfer_config(container: dict) -> dict:
    args = container["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


# ---- the prefill and decode vLLM -------------------------------------------------------------
@pytest.mark.parametrize("name", ["vllm", "all-options"])
def test_vllm_roles_are_a_deployment_each_with_its_sidecar(name):
    values = VALUES[name]
    documents = render(values)
    deployments = _deployments(documents)
    assert {"prefill", "decode", "proxy"} <= set(deployments)
    control = yaml.safe_load((CHART / "values.yaml").read_text())["ports"]["control"]
    secrets = _of_kind(documents, "Secret")
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        pod = deployments[role]["spec"]["template"]["spec"]
        _assert_pod_is_whole(pod)
        assert set(c["name"] for c in pod["containers"]) == {"vllm", "kvferry"}
        vllm = _containers(pod)["vllm"]
        assert vllm["args"][vllm["args"].index("--model") + 1] == "Qwen/Qwen3-8B"
        config = _kv_transfer_config(vllm)
        assert config["kv_connector"] == "KvferryConnector" and config["kv_connector_module_path"] == "kvferry.vllm"
        assert config["kv_role"] == kv_role
        extra = config["kv_connector_extra_config"]
        assert extra["url"] == f"http://127.0.0.1:{control}"
        assert not {"token", "remote_token"} & set(extra), "the token comes from the Secret, never the command line"
        # the connector and the sidecar read the token from the same Secret (the chart's)
        env = {e["name"]: e for e in vllm["env"]}
        sidecar_env = {e["name"]: e for e in _containers(pod)["kvferry"]["env"]}
        ref = env["KVFERRY_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert "value" not in env["KVFERRY_TOKEN"]
        assert ref == sidecar_env["KVFERRY_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["data"]
        # the prefill advertises its sidecar at the pod's address (a variable defined before it)
        names = [e["name"] for e in vllm["env"]]
        assert env["KVFERRY_CONNECTOR_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{control}"
        assert names.index("POD_IP") < names.index("KVFERRY_CONNECTOR_ADVERTISE_URL")
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # the connector comes from the sidecar's image when vLLM's has none
        assert env["PYTHONPATH"]["value"] == "/opt/kvferry-connector"
        assert _containers(pod)["kvferry-connector"]["image"] == _containers(pod)["kvferry"]["image"]
        # vLLM waits for its sidecar, then execs the server with the args
        assert "/readyz" in vllm["command"][2] and 'exec python3 -m vllm.entrypoints.openai.api_server "$@"' in vllm["command"][2]
        assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    if name == "all-options":
        literal = ALL_OPTIONS["token"]["value"]
        assert literal not in json.dumps([deployments[r] for r in ("prefill", "decode")])
        prefill = _containers(deployments["prefill"]["spec"]["template"]["spec"])
        assert prefill["vllm"]["args"][-4:] == ["--max-model-len", "8192", "--tensor-parallel-size", "2"]
        assert prefill["vllm"]["image"] == "vllm/vllm-openai:v0.33.0-cu130"
        assert _kv_transfer_config(prefill["vllm"])["kv_connector_extra_config"]["codec"] == "splitzip"
        assert {e["name"]: e for e in prefill["vllm"]["env"]}["KVFERRY_SHM_PREFIX"]["value"] == "kvferry-pd-"
        assert deployments["decode"]["spec"]["replicas"] == 3
        decode = {e["name"]: e for e in _containers(deployments["decode"]["spec"]["template"]["spec"])["vllm"]["env"]}
        assert decode["KVFERRY_CONNECTOR_PREFILL_URLS"]["value"] == "10.244.0.0/16"
        assert "KVFERRY_CONNECTOR_PREFILL_URLS" not in {e["name"] for e in prefill["vllm"]["env"]}
    else:
        assert not any(e["name"] == "KVFERRY_CONNECTOR_PREFILL_URLS" for d in deployments.values()
                       for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", []))


@pytest.mark.parametrize("name", list(VALUES))
def test_services_and_network_policies_select_the_pods(name):
    documents = render(VALUES[name])
    deployments = _deployments(documents)
    pods = {c: d["spec"]["template"]["metadata"]["labels"] for c, d in deployments.items()}
    with_sidecar = {c for c, d in deployments.items()
                    if "kvferry" in _containers(d["spec"]["template"]["spec"])}
    assert with_sidecar == set(pods) - {"proxy"}
    for component, deployment in deployments.items():
        _assert_pod_is_whole(deployment["spec"]["template"]["spec"])
        # each Deployment owns its pods and no other Deployment's
        for other, labels in pods.items():
            assert _selects(deployment["spec"]["selector"], labels) == (other == component), (component, other)
    services = _of_kind(documents, "Service")
    sidecars = next(s for s in services.values() if s["metadata"]["labels"]["app.kubernetes.io/component"] == "sidecar")
    assert {c for c, labels in pods.items() if _selects(sidecars["spec"]["selector"], labels)} == with_sidecar
    for service in services.values():
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in ("prefill", "decode", "proxy"):
            assert {c for c, labels in pods.items() if _selects(service["spec"]["selector"], labels)} == {component}
    for monitor in _of_kind(documents, "PodMonitor").values():
        assert {c for c, labels in pods.items() if _selects(monitor["spec"]["selector"], labels)} == with_sidecar
    for monitor in _of_kind(documents, "ServiceMonitor").values():
        assert [s for s in services.values() if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])] == [sidecars]
    policies = _of_kind(documents, "NetworkPolicy")
    if not VALUES[name].get("networkPolicy", {}).get("enabled"):
        assert not policies
        return
    ports = yaml.safe_load((CHART / "values.yaml").read_text())["ports"] | VALUES[name].get("ports", {})
    main = policies["test-kvferry"]
    assert {c for c, labels in pods.items() if _selects(main["spec"]["podSelector"], labels)} == with_sidecar
    by_port = {r["ports"][0]["port"]: r for r in main["spec"]["ingress"]}
    data = by_port[ports["data"]]
    assert [p["port"] for p in data["ports"]] == [ports["data"]] and len(data["from"]) == 1
    assert {c for c, labels in pods.items() if _selects(data["from"][0]["podSelector"], labels)} == with_sidecar
    if not VALUES[name]["networkPolicy"].get("peerLabels"):  # by default: this release's sidecars only
        other_release = dict(pods[next(iter(with_sidecar))], **{"kvferry.io/release": "other"})
        assert not _selects(data["from"][0]["podSelector"], other_release)
    control = by_port[ports["control"]]
    assert {c for c, labels in pods.items() if _selects(control["from"][0]["podSelector"], labels)} == with_sidecar
    if "prefill" in deployments:
        api = policies["test-kvferry-vllm"]
        assert {c for c, labels in pods.items() if _selects(api["spec"]["podSelector"], labels)} == {"prefill", "decode"}
        port = _containers(deployments["prefill"]["spec"]["template"]["spec"])["vllm"]["ports"][0]["containerPort"]
        assert [p["port"] for r in api["spec"]["ingress"] for p in r["ports"]] == [port]
        assert {c for c, labels in pods.items() if _selects(api["spec"]["ingress"][0]["from"][0]["podSelector"], labels)} == {"proxy"}


def test_proxy_runs_the_example_proxy_against_both_roles():
    """The proxy is the image's (the Dockerfile installs examples/vllm-pd/proxy.py): the chart
    carries no copy of it."""
    assert not list(CHART.rglob("proxy.py"))
    dockerfile = (ROOT / "Dockerfile").read_text()
    for values in (VLLM, ALL_OPTIONS):
        documents = render(values)
        proxy = _deployments(documents)["proxy"]
        pod = proxy["spec"]["template"]["spec"]
        _assert_pod_is_whole(pod)
        command = pod["containers"][0]["command"]
        assert command[:2] == ["python3", "/opt/kvferry-proxy/proxy.py"]
        assert f"COPY examples/vllm-pd/proxy.py {command[1]}" in dockerfile
        services = _of_kind(documents, "Service")
        vllm_port = values["vllm"].get("port", 8000)
        for role in ("prefill", "decode"):
            url = command[command.index(f"--{role}") + 1]
            assert url == f"http://test-kvferry-{role}:{vllm_port}"
            assert services[f"test-kvferry-{role}"]["spec"]["ports"][0]["port"] == vllm_port
        assert "ConfigMap" not in {d["kind"] for d in documents} and not pod.get("volumes")
    # one role alone: no proxy
    alone = render({"vllm": {"model": "m", "prefill": {"enabled": True}}})
    assert set(_deployments(alone)) == {"example", "prefill"}


def test_vllm_values_are_checked():
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmError, match="vllm.model"):
            chart.render({"vllm": {"prefill": {"enabled": True}}}, name="test")
        for key in ("token", "url"):  # the chart sets these; a token only ever comes from the Secret
            with pytest.raises(helm_python.HelmError):
                chart.render({"vllm": {"model": "m", "decode": {"enabled": True}, "connector": {key: "x"}}}, name="test")
    finally:
        chart.close()


def test_without_install_connector_vllm_image_is_used_as_is():
    deployments = _deployments(render({"vllm": {"model": "m", "installConnector": False, "decode": {"enabled": True}}}))
    pod = deployments["decode"]["spec"]["template"]["spec"]
    _assert_pod_is_whole(pod)
    assert "initContainers" not in pod
    assert "PYTHONPATH" not in {e["name"] for e in _containers(pod)["vllm"]["env"]}


def test_chart_and_image_versions_are_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"] == version


# ---- README and NOTES: the injection path as written --------------------------------------------
def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _set_values(command: str) -> dict:
    values: dict = {}
    words = shlex.split(command.replace("\\\n", " "))
    for flag, setting in zip(words, words[1:]):
        if flag == "--set":
            path, value = setting.split("=", 1)
            *parents, leaf = path.split(".")
            node = values
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = {"true": True, "false": False}.get(value, value)
    return values


@pytest.mark.parametrize("readme", ["README.md", "examples/vllm-pd/README.md"])
def test_readme_helm_install_deploys_prefill_decode_and_proxy(readme):
    section = _section((ROOT / readme).read_text(), "Deploying" if readme == "README.md" else "Kubernetes")
    command = next(b for b in _blocks(section, "bash") if "helm install" in b).split("\n\n")[0]
    assert " deploy/helm/kvferry " in command
    documents = render(_set_values(command))
    assert set(_deployments(documents)) == {"prefill", "decode", "proxy"}
    for doc in documents:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    if "port-forward" in section:  # the Service it names exists (release "pd" there, "test" here)
        service = re.search(r"port-forward svc/pd-(\S+)", section).group(1)
        assert f"test-{service}" in _of_kind(documents, "Service")


def test_readme_injection_deploys_as_written(tmp_path):
    """README's worker Deployment, in a chart that depends on this one: it validates, its pod
    defines every volume the sidecar mounts, and the chart's Service, PodMonitor and
    NetworkPolicy select it."""
    snippet = _blocks(_section((ROOT / "README.md").read_text(), "Deploying"), "yaml")[0]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    user = tmp_path / "worker"
    (user / "templates").mkdir(parents=True)
    (user / "charts").mkdir()
    (user / "Chart.yaml").write_text("apiVersion: v2\nname: worker\nversion: 1.0.0\n"
                                     f"dependencies:\n  - name: kvferry\n    version: {version}\n")
    shutil.copytree(CHART, user / "charts" / "kvferry")
    (user / "templates" / "engine.yaml").write_text(snippet)
    values = {"kvferry": {"example": {"enabled": False}, "networkPolicy": {"enabled": True},
                          "podMonitor": {"enabled": True}}}
    chart = helm_python.Chart.load(str(user))
    try:
        rendered = chart.render(values, name="w", namespace="serving")
    finally:
        chart.close()
    documents = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    for doc in documents:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    engine = _of_kind(documents, "Deployment")
    assert list(engine) == ["engine"]  # the example is off; nothing else runs pods
    template = engine["engine"]["spec"]["template"]
    pod, labels = template["spec"], template["metadata"]["labels"]
    assert [c["name"] for c in pod["containers"]] == ["engine", "kvferry"]
    _assert_pod_is_whole(pod)
    assert pod["securityContext"]["fsGroup"] == yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["fsGroup"]
    service = _of_kind(documents, "Service")["w-kvferry"]
    assert _selects(service["spec"]["selector"], labels)
    assert _selects(_of_kind(documents, "PodMonitor")["w-kvferry"]["spec"]["selector"], labels)
    policy = _of_kind(documents, "NetworkPolicy")["w-kvferry"]["spec"]
    assert _selects(policy["podSelector"], labels)
    assert all(_selects(rule["from"][0]["podSelector"], labels) for rule in policy["ingress"])
    sidecar = _containers(pod)["kvferry"]
    assert {e["name"]: e for e in sidecar["env"]}["KVFERRY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] in _of_kind(documents, "Secret")


def test_notes_and_readme_give_the_same_injection():
    readme = _blocks(_section((ROOT / "README.md").read_text(), "Deploying"), "yaml")[0]
    includes = re.compile(r'include "(kvferry\.\w+)" \.Subcharts\.kvferry')
    chart = helm_python.Chart.load(str(CHART))
    try:
        notes = {values_name: chart.render(values, name="test", namespace="serving")["kvferry/templates/NOTES.txt"]
                 for values_name, values in VALUES.items()}
    finally:
        chart.close()
    for text in notes.values():
        assert includes.findall(text) == includes.findall(readme) == ["kvferry.sidecarLabels", "kvferry.sidecar", "kvferry.volumes"]
        assert "shareProcessNamespace: true" in text and "shareProcessNamespace: true" in readme
    assert "svc/test-kvferry-proxy" in notes["vllm"] and "proxy" not in notes["default"].lower()
    assert "test-kvferry-prefill" in notes["all-options"] and "kv_consumer" in notes["all-options"]
