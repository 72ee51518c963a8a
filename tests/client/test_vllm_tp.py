"""The connector across tensor-parallel sizes, KV cache groups and FP8 caches: the head mapping
(``kvferry.client.tp``) as pure functions, then prefill and decode ranks with vLLM-CPU-shaped
caches (``[blocks, heads, block_size, 2 * head_size]`` per layer, heads split over the ranks)
against real sidecars, every decode page compared bit for bit with the re-layout it must be."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kvferry.client import Client, tp
from kvferry.client.vllm_core import (
    CacheLayout,
    Consumer,
    Heartbeats,
    IncompatibleCache,
    IncompatiblePeer,
    KvCache,
    LoadSpec,
    Producer,
    check_compat,
    compat_record,
    lease_name,
    pair_groups,
    remote_params,
)

from .conftest import TOKEN
from .test_vllm_core import config, pump, released

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 3, 16, 32, 32


# ---- the mapping --------------------------------------------------------------------------------
def test_rank_heads_split_and_replicate_as_vllm_does():
    assert [tp.rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [tp.rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [tp.rank_heads(1, 8, r) for r in range(8)] == [range(0, 1)] * 8  # MLA: every rank holds the latent
    with pytest.raises(tp.BadShape, match="do not split"):
        tp.rank_heads(6, 4, 0)
    with pytest.raises(tp.BadShape, match="replicate"):
        tp.rank_heads(2, 3, 0)


@pytest.mark.parametrize("heads,p_tp,d_tp", [(8, 4, 2), (8, 2, 4), (8, 1, 8), (8, 8, 1), (2, 4, 1), (2, 1, 4),
                                             (1, 4, 2), (1, 2, 4), (6, 2, 3), (4, 4, 4), (2, 4, 8)])
def test_every_decode_head_comes_from_a_prefill_rank_that_holds_it(heads, p_tp, d_tp):
    for d_rank in range(d_tp):
        got = []
        for s in tp.plan(heads, p_tp, d_tp, d_rank):
            held = tp.rank_heads(heads, p_tp, s.rank)
            got += [(s.dst + i, held[s.src + i]) for i in range(s.count)]
        assert got == list(enumerate(tp.rank_heads(heads, d_tp, d_rank)))


def test_plans_read_whole_ranks_and_slices_in_as_few_transfers_as_possible():
    assert tp.plan(8, 4, 2, 1) == [tp.Slice(2, 0, 0, 2), tp.Slice(3, 0, 2, 2)]  # P TP 4 -> D TP 2: two ranks whole
    assert tp.plan(8, 2, 4, 3) == [tp.Slice(1, 2, 0, 2)]  # P TP 2 -> D TP 4: half of rank 1
    assert tp.plan(1, 4, 2, 1) == [tp.Slice(1, 0, 0, 1)]  # MLA: one copy, ranks spread over replicas
    assert tp.plan(4, 2, 2, 1) == [tp.Slice(1, 0, 0, 2)]


def test_every_lease_is_ended_once_and_shared_ones_by_the_scheduler():
    for heads, p_tp, d_tp in [(8, 4, 2), (8, 2, 4), (1, 4, 2), (1, 2, 4), (2, 1, 4), (6, 2, 3)]:
        readers = tp.readers(heads, p_tp, d_tp)
        shared = tp.shared(heads, p_tp, d_tp)
        for loaded in (True, False):
            ended = [r for d in range(d_tp) for r in tp.releases(heads, p_tp, d_tp, d, loaded)]
            expect = sorted(range(p_tp)) if not loaded else sorted(set(range(p_tp)) - set(shared))
            assert sorted(ended) == expect, (heads, p_tp, d_tp, loaded)
        assert shared == [r for r, ds in readers.items() if len(ds) > 1]
    assert tp.shared(8, 2, 4) == [0, 1] and tp.shared(8, 4, 2) == []
    assert tp.readers(1, 4, 2) == {0: [0], 1: [1], 2: [], 3: []}  # MLA: two replicas nobody reads


def test_compatible_shapes_pass_and_others_are_named():
    base = {"model": "m", "dtype": "bfloat16", "kv_cache_dtype": "auto", "block_size": 32, "head_size": 64,
            "layers": 2, "layout": "LBHNC", "groups": ["FullAttentionSpec"]}
    check_compat(compat_record(tp=1, kv_heads=8, **base), compat_record(tp=4, kv_heads=8, **base), "p")
    check_compat(compat_record(kv_heads=8, **base), compat_record(kv_heads=8, **{**base, "block_size": 16}), "p")
    with pytest.raises(IncompatiblePeer, match=r"tp: prefill 3, decode 2 \(8 KV heads do not split over 3"):
        check_compat(compat_record(tp=2, kv_heads=8, **base), compat_record(tp=3, kv_heads=8, **base), "p")
    other = {**base, "layout": "LBNHC", "groups": ["SlidingWindowSpec:64", "FullAttentionSpec"], "block_size": 8}
    with pytest.raises(IncompatiblePeer) as refused:
        check_compat(compat_record(kv_heads=8, **base), compat_record(kv_heads=4, **other), "p")
    for named in ("block_size: prefill 8, decode 32", "kv_heads: prefill 4, decode 8",
                  "layout: prefill 'LBNHC', decode 'LBHNC'", "groups: prefill"):
        assert named in str(refused.value)


def test_dp_ranks_lease_under_names_of_their_own():
    assert lease_name("r", "req") != lease_name("r", "req", 1) != lease_name("r", "req", 2)
    assert lease_name("r", "req", 0) == lease_name("r", "req")
    assert "-dp1-" in remote_params("req", [1], config_url("http://p"), dp_rank=1)["lease"]


def config_url(url: str):
    from kvferry.client.vllm_core import ConnectorConfig

    return ConnectorConfig(url=url)


def test_groups_pair_from_the_prompt_end_without_dropped_blocks():
    # two groups: sliding window (its oldest block already dropped by the prefill) and full attention
    src, dst = pair_groups(((7, 8, 9), (10, 11, 12)), [[0, 3, 4], [1, 2, 5]])
    assert (src, dst) == ([3, 4, 1, 2, 5], [8, 9, 10, 11, 12])
    assert pair_groups((5, 6), [0, 1, 2]) == ([1, 2], [5, 6])  # one group: block ids as they are
    # a null block on the decode's side is skipped too: no block id repeats where the KV lands
    assert pair_groups([[5, 6], [0, 0, 7]], [[1, 2], [3, 4, 8]]) == ([1, 2, 8], [5, 6, 7])
    with pytest.raises(IncompatibleCache, match="2 KV cache groups, this decode has 1"):
        pair_groups((5,), [[1], [2]])


def test_layout_finds_the_head_dimension_and_fp8_bytes():
    layers = [torch.zeros(BLOCKS, 2, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8)]
    layout = CacheLayout.of(layers, BLOCKS, fp8="float8_e4m3fn", heads=2)
    assert (layout.dtype, layout.head_dim, layout.heads, layout.block_shape) == (
        "float8_e4m3fn", 0, 2, (1, BLOCK_SIZE, 2 * HEAD_SIZE))
    with pytest.raises(IncompatibleCache, match="torch.uint8 without an FP8"):
        CacheLayout.of(layers, BLOCKS)
    square = [torch.zeros(BLOCKS, BLOCK_SIZE, BLOCK_SIZE, HEAD_SIZE, dtype=torch.bfloat16)]
    with pytest.raises(IncompatibleCache, match="cannot tell which dimension"):
        CacheLayout.of(square, BLOCKS, heads=BLOCK_SIZE)
    named = CacheLayout.of(square, BLOCKS, heads=BLOCK_SIZE, head_dim=0)
    assert named.heads == BLOCK_SIZE
    with pytest.raises(IncompatibleCache, match="whole blocks"):
        replace(named, in_place=True).blocks([1], first_head=1, count=2)


# ---- against real sidecars ----------------------------------------------------------------------
def whole_cache(heads: int, dtype=torch.bfloat16, seed: int = 3, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Every KV head of every layer, ``[layers, blocks, heads, block_size, 2 * head_size]``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (LAYERS, BLOCKS, heads, block_size, 2 * HEAD_SIZE), generator=g, dtype=torch.uint8)
    return (torch.randn((LAYERS, BLOCKS, heads, block_size, 2 * HEAD_SIZE), generator=g) * 0.5).to(dtype)


def rank_layers(whole: torch.Tensor, heads: int, size: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s per-layer caches: its heads of ``whole``, laid out as vLLM-CPU allocates them."""
    held = tp.rank_heads(heads, size, rank)
    return [layer[:, held.start:held.stop].contiguous() for layer in whole]


class Instance:
    """One vLLM instance's workers (one cache each, all on one sidecar), prefill or decode."""

    def __init__(self, side, name: str, heads: int, size: int, whole: torch.Tensor | None, fp8: str | None = None,
                 block_size: int = BLOCK_SIZE, **settings):
        self.side, self.size, self.heads = side, size, heads
        dtype = whole.dtype if whole is not None else (torch.uint8 if fp8 else torch.bfloat16)
        self.layers = [rank_layers(whole, heads, size, r) if whole is not None else
                       [torch.zeros(BLOCKS, len(tp.rank_heads(heads, size, r)), block_size, 2 * HEAD_SIZE,
                                    dtype=dtype) for _ in range(LAYERS)] for r in range(size)]
        self.caches = [KvCache(Client(side.url, token=TOKEN), f"{name}-r{r}", self.layers[r], BLOCKS, fp8=fp8,
                               heads=len(tp.rank_heads(heads, size, r)), block_size=block_size) for r in range(size)]
        self.compat = compat_record(model="m", dtype="bfloat16", kv_cache_dtype="fp8" if fp8 else "auto",
                                    block_size=block_size, tp=size, kv_heads=heads, head_size=HEAD_SIZE, layers=LAYERS)
        self.settings = settings

    def producers(self) -> list[Producer]:
        return [Producer(config(self.side, **self.settings), c, r) for r, c in enumerate(self.caches)]

    def consumers(self) -> list[Consumer]:
        return [Consumer(config(self.side, **self.settings), c, r, compat=self.compat)
                for r, c in enumerate(self.caches)]

    def close(self) -> None:
        for c in self.caches:
            c.close()


def expected(whole: torch.Tensor, heads: int, size: int, rank: int, src: list[int]) -> torch.Tensor:
    held = tp.rank_heads(heads, size, rank)
    return whole[:, src][:, :, held.start:held.stop]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("heads,p_tp,d_tp,codec", [(4, 2, 1, "raw"), (4, 1, 2, "raw"), (4, 2, 1, "splitzip"),
                                                   (2, 1, 4, "raw"), (1, 2, 1, "raw"), (4, 2, 2, "auto")])
def test_heads_cross_tensor_parallel_sizes_bit_for_bit(sidecars, heads, p_tp, d_tp, codec):
    """P TP=p ranks' head-split caches feed D TP=d ranks: each decode rank's pages are exactly the
    heads it holds of the prefill's blocks; no other block is written; every lease ends, the ones
    several decode ranks read only once the scheduler saw the request loaded on every rank."""
    p_side, d_side = sidecars
    whole = whole_cache(heads)
    tag = f"{heads}-{p_tp}-{d_tp}-{codec}"
    prefill = Instance(p_side, f"tp-p-{tag}", heads, p_tp, whole, codec=codec)
    decode = Instance(d_side, f"tp-d-{tag}", heads, d_tp, None, codec=codec)
    producers, consumers = prefill.producers(), decode.consumers()
    beats = Heartbeats(config(d_side))
    try:
        src, dst = [3, 9, 4, 15], [12, 1, 2, 7]
        rid = f"req-{tag}"
        for p in producers:
            p.save(rid, src)
        params = remote_params(rid, src, config(p_side), compat=prefill.compat)
        shared = beats.shared_leases(params, decode.compat)
        for c in consumers:
            assert c.start(LoadSpec(f"dec-{tag}", tuple(dst), params)).error is None
        for c in consumers:
            assert pump(c) == ({f"dec-{tag}"}, set()), c.stats
        for rank in range(d_tp):
            got = torch.stack(decode.layers[rank])
            assert torch.equal(bits(got[:, dst]), bits(expected(whole, heads, d_tp, rank, src)))
            assert not got[:, [b for b in range(BLOCKS) if b not in dst]].any()
        reads = sum(len(tp.plan(heads, p_tp, d_tp, r)) if p_tp != d_tp else 1 for r in range(d_tp))
        assert sum(len(c.stats[-1]["transfers"]) for c in consumers) == reads
        if shared:
            time.sleep(0.3)
            assert all(p.finished_sending({rid}) == set() for p in producers if p.rank in tp.shared(heads, p_tp, d_tp))
            beats.release_later(params["url"], shared)
        assert all(released(p, rid) for p in producers)
    finally:
        beats.close()
        for worker in [*producers, *consumers]:
            worker.close()
        prefill.close()
        decode.close()


def by_token(layers: torch.Tensor, blocks: list[int], tokens: int) -> torch.Tensor:
    """``[layers, blocks, heads, block_size, c]`` pages of ``blocks`` as ``[layers, heads, tokens, c]``."""
    return layers[:, blocks].movedim(1, 2).flatten(2, 3)[:, :, :tokens]


@pytest.mark.parametrize("p_tp,d_tp,sizes", [(2, 1, (32, 64)), (1, 2, (64, 16))])
def test_tensor_parallel_and_block_sizes_differ_at_once(sidecars, p_tp, d_tp, sizes):
    """Heads split over other ranks and blocks of other sizes: each decode rank's blocks hold its
    heads of the prompt's tokens, granule for granule, bit for bit."""
    p_side, d_side = sidecars
    heads, tokens, (p_size, d_size) = 4, 100, sizes
    whole = whole_cache(heads, block_size=p_size)
    tag = f"{p_tp}-{d_tp}-{p_size}-{d_size}"
    prefill = Instance(p_side, f"tpbs-p-{tag}", heads, p_tp, whole, block_size=p_size)
    decode = Instance(d_side, f"tpbs-d-{tag}", heads, d_tp, None, block_size=d_size)
    producers, consumers = prefill.producers(), decode.consumers()
    try:
        src, dst = [3, 9, 4, 15, 0, 6, 11][:-(-tokens // p_size)], [12, 1, 2, 7, 5, 8, 13][:-(-tokens // d_size)]
        for p in producers:
            p.save(f"req-{tag}", src)
        params = dict(remote_params(f"req-{tag}", src, config(p_side), num_tokens=tokens, compat=prefill.compat),
                      block_size=p_size)
        for c in consumers:
            assert c.start(LoadSpec(f"dec-{tag}", tuple(dst), params, tokens)).error is None
        for c in consumers:
            assert pump(c) == ({f"dec-{tag}"}, set()), c.stats
        for rank in range(d_tp):
            held = tp.rank_heads(heads, d_tp, rank)
            got = torch.stack(decode.layers[rank])
            assert torch.equal(bits(by_token(got, dst, tokens)), bits(by_token(whole, src, tokens)[:, held]))
            assert not got[:, [b for b in range(BLOCKS) if b not in dst]].any()
    finally:
        for worker in [*producers, *consumers]:
            worker.close()
        prefill.close()
        decode.close()


def test_fp8_caches_cross_as_bytes_with_any_codec(sidecars):
    """vLLM keeps an FP8 cache as uint8: it crosses as float8_e4m3fn (the entropy codecs' alphabet),
    bit for bit, across a TP change too."""
    p_side, d_side = sidecars
    whole = whole_cache(2, torch.uint8)
    prefill = Instance(p_side, "fp8-p", 2, 2, whole, fp8="float8_e4m3fn")
    decode = Instance(d_side, "fp8-d", 2, 1, None, fp8="float8_e4m3fn")
    assert prefill.caches[0].layout.dtype == "float8_e4m3fn"
    producers, consumers = prefill.producers(), decode.consumers()
    try:
        for i, codec in enumerate(("raw", "auto")):
            src, dst = [2 + i, 5 + i], [8 + i, 11 + i]
            for p in producers:
                p.save(f"f{i}", src)
            params = {**remote_params(f"f{i}", src, config(p_side), compat=prefill.compat), "codec": codec}
            consumers[0].start(LoadSpec(f"fd{i}", tuple(dst), params))
            assert pump(consumers[0]) == ({f"fd{i}"}, set())
            assert torch.equal(torch.stack(decode.layers[0])[:, dst], whole[:, src])
    finally:
        for worker in [*producers, *consumers]:
            worker.close()
        prefill.close()
        decode.close()


def test_hybrid_groups_overlaying_one_cache_cross_in_one_pull(sidecars):
    """vLLM's hybrid allocator: a sliding-window and a full-attention group share each cache tensor
    (one layer name per group, the same memory); the prefill's dropped window blocks are skipped."""
    p_side, d_side = sidecars
    whole = whole_cache(2)
    p_layers = [t.contiguous() for t in whole]
    d_layers = [torch.zeros_like(t) for t in p_layers]
    p_cache = KvCache(Client(p_side.url, token=TOKEN), "hy-p", [p_layers[0], p_layers[0], *p_layers[1:]], BLOCKS,
                      heads=2)
    d_cache = KvCache(Client(d_side.url, token=TOKEN), "hy-d", [d_layers[0], *d_layers[1:], d_layers[0]], BLOCKS,
                      heads=2)
    assert p_cache.layout.num_layers == LAYERS  # one layer per tensor, not per name
    producer, consumer = Producer(config(p_side), p_cache), Consumer(config(d_side), d_cache)
    try:
        remote = [[0, 3, 4], [6, 7, 8]]  # window group: its first block dropped (vLLM's null block)
        producer.save("h", [b for g in remote for b in g])
        consumer.start(LoadSpec("hd", ((10, 11), (12, 13, 14)), remote_params("h", remote, config(p_side))))
        assert pump(consumer) == ({"hd"}, set())
        got = torch.stack(d_layers)
        assert torch.equal(bits(got[:, [10, 11, 12, 13, 14]]), bits(whole[:, [3, 4, 6, 7, 8]]))
        assert not got[:, [b for b in range(BLOCKS) if b not in (10, 11, 12, 13, 14)]].any()
        assert released(producer, "h")
    finally:
        producer.close()
        consumer.close()
        p_cache.close()
        d_cache.close()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_an_mla_latent_is_read_once_from_one_rank(sidecars, p_tp, d_tp):
    """MLA: a page is ``[block_size, latent]``, no head dimension, the same on every rank: each
    decode rank reads one prefill rank's copy, and a copy nobody reads still has its lease ended."""
    p_side, d_side = sidecars
    g = torch.Generator().manual_seed(9)
    latent = (torch.randn((LAYERS, BLOCKS, BLOCK_SIZE, 96), generator=g)).to(torch.bfloat16)
    record = {"model": "mla", "dtype": "bfloat16", "block_size": BLOCK_SIZE, "kv_heads": 1, "layout": "LBHNC+mla"}
    p_layers = [[t.clone() for t in latent] for _ in range(p_tp)]
    d_layers = [[torch.zeros_like(t) for t in latent] for _ in range(d_tp)]
    p_caches = [KvCache(Client(p_side.url, token=TOKEN), f"mla-p{p_tp}{d_tp}-r{r}", p_layers[r], BLOCKS)
                for r in range(p_tp)]
    d_caches = [KvCache(Client(d_side.url, token=TOKEN), f"mla-d{p_tp}{d_tp}-r{r}", d_layers[r], BLOCKS)
                for r in range(d_tp)]
    producers = [Producer(config(p_side), c, r) for r, c in enumerate(p_caches)]
    consumers = [Consumer(config(d_side), c, r, compat=compat_record(tp=d_tp, **record))
                 for r, c in enumerate(d_caches)]
    beats = Heartbeats(config(d_side))
    try:
        src, dst = [1, 6, 2], [4, 3, 9]
        for p in producers:
            p.save("m", src)
        params = remote_params("m", src, config(p_side), compat=compat_record(tp=p_tp, **record))
        for c in consumers:
            c.start(LoadSpec("md", tuple(dst), params))
        for rank, c in enumerate(consumers):
            assert pump(c) == ({"md"}, set())
            assert len(c.stats[-1]["transfers"]) == 1
            assert torch.equal(bits(torch.stack(d_layers[rank])[:, dst]), bits(latent[:, src]))
        beats.release_later(params["url"], beats.shared_leases(params, consumers[0].compat))
        assert all(released(p, "m") for p in producers)
    finally:
        beats.close()
        for worker in [*producers, *consumers]:
            worker.close()
        for c in [*p_caches, *d_caches]:
            c.close()
