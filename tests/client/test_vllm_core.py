"""The connector's core against real sidecars, without vLLM: vLLM-shaped per-layer KV tensors on
two 'workers', the hook sequence of a P/D request replayed (save + lease on the prefill, pull +
load + release on the decode), and what must happen when the lease lapses, the layouts differ,
the prefill's sidecar dies or the KV is corrupted on the wire."""

from __future__ import annotations

import base64
import logging
import struct
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvferry.client import Client, packed
from kvferry.client import vllm_core
from kvferry.client.sdk import MAX_RENEW
from kvferry.client.vllm_core import (
    MAX_RANKS,
    CacheLayout,
    ConnectorConfig,
    Consumer,
    Heartbeats,
    IncompatibleCache,
    KvCache,
    LoadSpec,
    PeerClients,
    Producer,
    RefusedPrefill,
    check_remote,
    compat_record,
    fresh_blocks,
    lease_name,
    match_blocks,
    pair_granules,
    pair_groups,
    remote_params,
)
from kvferry.demo import free_port, start_sidecar

from .conftest import TOKEN, log_path, ready, spawn, stop

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 24, 3, 32, 64


def vllm_layers(seed: int | None, shape: str = "kv-first", block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """Per-layer KV as vLLM allocates it: views into one buffer; K/V outside or inside the block dim."""
    dims = {"kv-first": (2, BLOCKS, HEADS, block_size, HEAD_DIM), "block-first": (BLOCKS, 2, HEADS, block_size, HEAD_DIM)}[shape]
    if seed is None:
        buffer = torch.zeros((LAYERS, *dims), dtype=torch.bfloat16)
    else:
        buffer = (torch.randn((LAYERS, *dims), generator=torch.Generator().manual_seed(seed)) * 0.7).to(torch.bfloat16)
    return list(buffer.unbind(0))


def pages(layers: list[torch.Tensor], ids: list[int], block_dim: int) -> torch.Tensor:
    return torch.stack([t.index_select(block_dim, torch.tensor(ids)).movedim(block_dim, 0) for t in layers])


def config(daemon, **kw) -> ConnectorConfig:
    return ConnectorConfig(url=daemon.url, token=TOKEN, **kw)


def pump(consumer: Consumer, timeout: float = 20.0) -> tuple[set[str], set[str]]:
    """get_finished as vLLM calls it: every step until something ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        received, failed = consumer.poll()
        if received or failed:
            return received, failed
        time.sleep(0.002)
    raise AssertionError("the pull neither finished nor failed")


def released(producer: Producer, request_id: str, timeout: float = 10.0) -> bool:
    """The prefill reports the request sent once the decode deleted its lease (on the decode's
    worker thread, so a step or two later), as vLLM sees it: finished_sending every step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if producer.finished_sending({request_id}) == {request_id}:
            return True
        time.sleep(0.005)
    return False


def leased(producer: Producer, request_id: str, timeout: float = 10.0) -> None:
    """The lease thread took the request's lease (the sidecar holds it)."""
    deadline = time.monotonic() + timeout
    while producer.leases[request_id].generation is None and producer.leases[request_id].held:
        assert time.monotonic() < deadline, "the lease was not taken"
        time.sleep(0.01)
    assert producer.leases[request_id].held


def start_and_step(consumer: Consumer, spec: LoadSpec):
    """``start`` a pull, then ``poll`` as vLLM's steps do until it ends: (the pull, what the last
    poll reported, the longest the start or a poll took)."""
    began = time.monotonic()
    pull = consumer.start(spec)
    longest = time.monotonic() - began
    outcome = (set(), set())
    while outcome == (set(), set()):
        assert time.monotonic() - began < 30, "the stalled pull never failed"
        step = time.monotonic()
        outcome = consumer.poll()
        longest = max(longest, time.monotonic() - step)
        time.sleep(0.002)
    return pull, outcome, longest


def regions_of(daemon) -> set[str]:
    return {r["name"] for r in daemon.client.list_regions()}


@pytest.fixture
def pd(sidecars, request):
    """A prefill worker's and a decode worker's caches, registered with their sidecars."""
    prefill, decode = sidecars
    shape = getattr(request, "param", "kv-first")
    p_layers, d_layers = vllm_layers(1, shape), vllm_layers(None, shape)
    suffix = f"{request.node.name}".replace("[", "-").replace("]", "")[-40:]
    p_cache = KvCache(Client(prefill.url, token=TOKEN), f"p-{suffix}", p_layers, BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), f"d-{suffix}", d_layers, BLOCKS)
    yield prefill, decode, p_cache, d_cache, p_layers, d_layers
    p_cache.close()
    d_cache.close()


def test_config_extra_over_environment():
    env = {"KVFERRY_CONNECTOR_URL": "http://sidecar:7700", "KVFERRY_CONNECTOR_CODEC": "raw",
           "KVFERRY_CONNECTOR_LEASE_SECONDS": "5"}
    c = ConnectorConfig.load({"codec": "splitzip"}, env)
    assert (c.url, c.codec, c.lease_seconds) == ("http://sidecar:7700", "splitzip", 5.0)
    assert ConnectorConfig.load({}, {}).codec == "auto"
    with pytest.raises(ValueError, match="unknown kvferry settings.*codek"):
        ConnectorConfig.load({"codek": "raw"}, {})


def test_layout_finds_the_block_dimension():
    assert CacheLayout.of(vllm_layers(0, "kv-first"), BLOCKS).block_dims == (1,) * LAYERS
    layout = CacheLayout.of(vllm_layers(0, "block-first"), BLOCKS)
    assert layout.block_dims == (0,) * LAYERS
    assert layout.block_shape == (LAYERS, 2, HEADS, BLOCK_SIZE, HEAD_DIM)
    with pytest.raises(IncompatibleCache, match="bf16, fp16 and fp8"):
        CacheLayout.of([torch.zeros(2, BLOCKS, 4)], BLOCKS)
    with pytest.raises(IncompatibleCache, match="head layout, layer count or dtype"):
        layout.check_peer({"block_shape": [LAYERS, 2, HEADS, 16, HEAD_DIM], "dtype": "bfloat16", "num_blocks": 9}, "p:1")


@pytest.mark.parametrize("shape", ["kv-first", "block-first"])
def test_in_place_layout_maps_vllm_blocks_to_its_own_memory(shape):
    """Layers end to end in one buffer (as vLLM allocates them) are lent as they are: vLLM block
    ``b`` is one id spread over the region's blocks, which hold exactly that block's pages of every layer."""
    from kvferry.engine.blocks import Blocks

    layers = vllm_layers(3, shape)
    layout = CacheLayout.of(layers, BLOCKS)
    view = layout.in_place_view(layers)
    assert view is not None and view.data_ptr() == layers[0].data_ptr()
    placed = replace(layout, in_place=True)
    planes = LAYERS * (2 if shape == "kv-first" else 1)
    assert placed.planes == planes and view.shape == (BLOCKS * planes, *placed.block_shape)
    ids = [5, 0, 17]
    spread = placed.blocks(ids)
    assert spread == packed(ids, planes, BLOCKS) and (spread["count"], spread["stride"]) == (planes, BLOCKS)
    assert struct.unpack("<3I", base64.b64decode(spread["packed"])) == tuple(ids)
    resolved = Blocks(ids=tuple(ids), spread=(planes, BLOCKS)).resolve(len(view))
    block_dim = layout.block_dims[0]
    expected = pages(layers, ids, block_dim)  # [layers, blocks, *page]
    got = view[resolved].view(len(ids), LAYERS, *layout.page_shape)  # block by block, layer by layer
    assert torch.equal(got.transpose(0, 1).view(torch.int16), expected.view(torch.int16))
    assert placed.blocks(ids, num_blocks=40) == packed(ids, planes, 40)
    assert placed.check_peer({"block_shape": list(placed.block_shape), "dtype": "bfloat16",
                              "num_blocks": 40 * planes}, "p:1") == 40
    with pytest.raises(IncompatibleCache, match="in place"):  # a mirror's blocks do not fit
        placed.check_peer({"block_shape": list(layout.block_shape), "dtype": "bfloat16", "num_blocks": 40}, "p:1")
    assert layout.blocks(ids) == packed(ids) and layout.planes == 1


def test_in_place_needs_the_layers_end_to_end():
    apart = [t.clone() for t in vllm_layers(0)]  # one allocation each
    assert CacheLayout.of(apart, BLOCKS).in_place_view(apart) is None
    layers = vllm_layers(0)
    swapped = [layers[1], layers[0], *layers[2:]]
    assert CacheLayout.of(swapped, BLOCKS).in_place_view(swapped) is None
    strided = [t.transpose(-1, -2) for t in layers]
    assert CacheLayout.of(strided, BLOCKS).in_place_view(strided) is None


def test_blocks_match_from_the_prompt_end():
    assert match_blocks([7, 8], [1, 2, 3]) == ([2, 3], [7, 8])
    with pytest.raises(IncompatibleCache):
        match_blocks([1, 2, 3], [4, 5])
    assert lease_name("kv", "cmpl-1/é") == lease_name("kv", "cmpl-1/é") != lease_name("kv", "cmpl-2")


def test_blocks_pair_by_the_tokens_they_hold():
    """The prefill's blocks start at the prompt's first and may run past it (a generated token, lookahead
    slots); the decode's fresh ones start where its own prefix cache stopped. Each decode block gets
    the prefill's block of the same prompt position."""
    assert match_blocks([21, 22], [10, 11, 12, 13], start=0, count=2) == ([10, 11], [21, 22])
    assert match_blocks([21, 22], [10, 11, 12, 13], count=2) == ([10, 11], [21, 22])  # ends at the prompt's end
    # a prompt of 4 blocks, the first in the decode's prefix cache, the prefill one block past it
    assert match_blocks([21, 22, 23], [10, 11, 12, 13, 14], start=1, count=4) == ([11, 12, 13], [21, 22, 23])
    assert match_blocks([22, 23], [10, 11, 12, 13, 14], count=4) == ([12, 13], [22, 23])
    # a decode block past the prompt (a lookahead slot) is not written
    assert match_blocks([21, 22, 23], [10, 11, 12], start=1, count=3) == ([11, 12], [21, 22])
    assert match_blocks([21], [10, 11], start=2, count=2) == ([], [])
    with pytest.raises(IncompatibleCache, match="the prefill holds 2"):
        match_blocks([21, 22], [10, 11], start=1, count=3)
    # groups: a window group's fresh blocks start past its dropped ones, full attention's past the prefix hit
    assert pair_groups([[7], [8, 9]], [[0, 0, 3, 4], [5, 6, 1, 2]], starts=(2, 1), count=3) == ([3, 6, 1], [7, 8, 9])


def test_the_fresh_blocks_of_a_pull_and_where_they_start():
    def block(i: int, hashed: bool = False, null: bool = False):
        return SimpleNamespace(block_id=i, block_hash=b"h" if hashed else None, is_null=null)

    assert fresh_blocks([[block(4, True), block(5, True), block(6), block(7)]]) == ((6, 7), (2,))
    window = [block(0, null=True), block(0, null=True), block(9), block(3)]
    assert fresh_blocks([window, [block(4, True), block(8), block(1), block(2)]]) == (((9, 3), (8, 1, 2)), (2, 1))
    assert fresh_blocks([[block(4, True)]]) == ((), (1,))


@pytest.mark.parametrize("starts", [(), (1,)], ids=["by-tokens", "by-starts"])
def test_a_prefill_past_the_prompt_feeds_each_decode_block_its_own_tokens(pd, starts):
    """The prefill's blocks run one past the prompt's (80 tokens: 3 blocks of 32); the decode's
    prefix cache held the first: its two fresh blocks get the prompt's second and third."""
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    record = compat_record(block_size=BLOCK_SIZE, kv_heads=HEADS)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache, compat=record)
    try:
        src, request = [3, 9, 4, 17], f"req-past-{len(starts)}"
        producer.save(request, src)
        params = {**remote_params(request, src, config(prefill), num_tokens=81, compat=record),
                  "block_size": BLOCK_SIZE}
        spec = LoadSpec(f"dec-{request}", (20, 1), params, 80)  # its prompt: 80 tokens
        pull = consumer.start(replace(spec, starts=starts) if starts else spec)
        assert pump(consumer) == ({f"dec-{request}"}, set()), pull.error
        block_dim = p_cache.layout.block_dims[0]
        assert torch.equal(pages(d_layers, [20, 1], block_dim).view(torch.int16),
                           pages(p_layers, [9, 4], block_dim).view(torch.int16))
        assert released(producer, request)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("pd", ["kv-first", "block-first"], indirect=True)
@pytest.mark.parametrize("codec", ["raw", "splitzip", "auto"])
def test_request_kv_crosses_in_one_transfer(pd, codec):
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    producer = Producer(config(prefill, codec=codec), p_cache)
    consumer = Consumer(config(decode, codec=codec), d_cache)
    src, dst = [3, 9, 4, 17, 0], [20, 1, 2, 11, 5]
    before = len(prefill.client.transfers(direction="out"))

    producer.save("req-1", src)  # wait_for_save of the step that computed the prompt
    assert producer.finished_sending(set()) == set()  # leased: vLLM keeps the blocks
    params = remote_params("req-1", src, config(prefill))
    pull = consumer.start(LoadSpec("dec-1", tuple(dst), params))
    assert pull.error is None, pull.error
    received, failed = pump(consumer)
    assert (received, failed) == ({"dec-1"}, set())

    block_dim = p_cache.layout.block_dims[0]
    assert torch.equal(pages(d_layers, dst, block_dim).view(torch.int16), pages(p_layers, src, block_dim).view(torch.int16))
    others = [b for b in range(BLOCKS) if b not in dst]
    assert not pages(d_layers, others, block_dim).any()  # nothing else written
    outgoing = prefill.client.transfers(direction="out")
    assert len(outgoing) == before + 1  # one transfer for all layers of the request
    sent = prefill.client.wait(outgoing[0]["id"], timeout=30)  # the DONE may still be on its way
    assert sent["chosen_codec"] == consumer.stats[-1]["codec"] and sent["state"] == "done"
    if codec != "auto":
        assert sent["chosen_codec"] == codec
    assert consumer.stats[-1]["wait_seconds"] >= consumer.stats[-1]["transfer_seconds"] > 0

    # the decode deletes the lease; the prefill frees the blocks once vLLM has finished the request
    assert producer.finished_sending(set()) == set()
    assert released(producer, "req-1")
    assert producer.leases == {}


def pull_leaves_while_workers_are_held(producer: Producer, consumer: Consumer, prefill, decode, p_cache,
                                       p_layers, d_layers, name: str) -> None:
    """A first pull meets the prefill's sidecar from a worker thread; a second one is sent by
    ``start`` itself, so its KV crosses while every worker thread is held (as a step busy in
    Python holds them), and the worker only reads the ends once let go."""
    import threading

    from kvferry.client.vllm_core import Pull

    gate = threading.Event()
    try:
        cold = LoadSpec(f"dec-{name}-cold", (3, 4), remote_params(f"{name}-cold", [1, 2], config(prefill)))
        producer.save(f"{name}-cold", [1, 2])
        leased(producer, f"{name}-cold")
        assert consumer._send_early(Pull(cold, 0.0)) is None  # a first contact: nothing sent from the step
        consumer.start(cold)
        assert pump(consumer) == ({f"dec-{name}-cold"}, set())

        producer.save(f"{name}-warm", [5, 6, 7])
        leased(producer, f"{name}-warm")
        held = [consumer._waiters.submit(gate.wait, 30) for _ in range(64)]  # every worker thread, and a queue
        before = {t["id"] for t in decode.client.transfers(direction="in")}
        spec = LoadSpec(f"dec-{name}-warm", (8, 9, 10), remote_params(f"{name}-warm", [5, 6, 7], config(prefill)))
        pull = consumer.start(spec)
        deadline = time.monotonic() + 20
        while not [t for t in decode.client.transfers(direction="in") if t["id"] not in before and t["state"] == "done"]:
            assert time.monotonic() < deadline, "the pull did not leave while the worker threads were held"
            time.sleep(0.01)
        assert consumer.poll() == (set(), set())  # the worker has not read the end: not reported yet
        gate.set()
        assert all(h.result(30) for h in held)
        assert pump(consumer) == ({f"dec-{name}-warm"}, set())
        block_dim = p_cache.layout.block_dims[0]
        assert torch.equal(pages(d_layers, [8, 9, 10], block_dim).view(torch.int16),
                           pages(p_layers, [5, 6, 7], block_dim).view(torch.int16))
        assert pull.transfer_id in {t["id"] for t in decode.client.transfers(direction="in")} - before
        assert producer.finished_sending(set()) == set() and released(producer, f"{name}-warm")
    finally:
        gate.set()


@pytest.mark.parametrize("control", ["http", "auto"])
def test_a_pull_leaves_from_the_step_once_both_sidecars_were_met(pd, control):
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, control=control), d_cache)
    try:
        pull_leaves_while_workers_are_held(producer, consumer, prefill, decode, p_cache, p_layers, d_layers, "early")
    finally:
        consumer.close()
        producer.close()


def test_a_lease_is_asked_for_from_the_step_once_the_sidecar_was_met(pd):
    """The first lease opens the connection from the lease thread; later ones are asked for by
    ``save`` itself on it, so the sidecar holds the lease while the lease thread is held (as a
    step busy in Python holds it), and the thread only reads the answer once let go."""
    import threading

    prefill, _, p_cache, _, _, _ = pd
    producer = Producer(config(prefill), p_cache)
    gate = threading.Event()
    try:
        producer.save("first", [1, 2])
        leased(producer, "first")
        held = producer._calls.submit(gate.wait, 30)  # the lease thread, busy until the gate opens
        lease = producer.save("second", [3, 4])
        deadline = time.monotonic() + 20
        while lease.region not in regions_of(prefill):
            assert time.monotonic() < deadline, "the lease was not asked for while the lease thread was held"
            time.sleep(0.01)
        assert lease.generation is None  # its answer is the thread's to read
        gate.set()
        assert held.result(30)
        leased(producer, "second")
        assert prefill.client.region(lease.region)["view_of"] == p_cache.name
    finally:
        gate.set()
        producer.close()


def test_lease_lapses_and_a_late_pull_fails(pd):
    """A lease neither pulled nor renewed ends after lease_seconds: the sidecar deletes the region
    and the prefill frees the blocks; a late pull then finds no region (never reused blocks)."""
    prefill, decode, p_cache, d_cache, _, d_layers = pd
    producer = Producer(config(prefill, lease_seconds=1), p_cache)
    try:
        producer.save("req-2", [1, 2])
        leased(producer, "req-2")
        assert producer.finished_sending({"req-2"}) == set()
        lease = producer.leases["req-2"].region
        assert released(producer, "req-2", timeout=30)  # never stranded
        assert lease not in regions_of(prefill), regions_of(prefill)
        consumer = Consumer(config(decode, load_timeout=2), d_cache)
        pull = consumer.start(LoadSpec("dec-2", (4, 5), remote_params("req-2", [1, 2], config(prefill))))
        assert pump(consumer) == (set(), {"dec-2"})
        assert "NotFound" in pull.error  # the blocks may be reused already: nothing is read
        assert consumer.failed_blocks["dec-2"] == (4, 5)
        assert consumer.interval.data["failures"] == {"lease_gone": 1}
        assert not torch.stack(d_layers).any()
        consumer.close()
    finally:
        producer.close()


def test_a_decode_queue_longer_than_the_lease_keeps_the_kv_by_heartbeats(pd):
    """The decode renews the lease while the request waits in its queue: a wait of several lease
    periods still loads the KV, and the lease is the decode's to end."""
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    producer = Producer(config(prefill, lease_seconds=1.5), p_cache)
    beats = Heartbeats(config(decode, lease_seconds=1.5, heartbeat_seconds=0.3))
    try:
        producer.save("req-h", [2, 3, 4])
        leased(producer, "req-h")
        params = remote_params("req-h", [2, 3, 4], config(prefill))
        beats.track("dec-h", params)  # on_new_request: the request waits in the decode's queue
        time.sleep(5)  # more than three leases long
        assert beats.sent >= 3
        assert producer.finished_sending({"req-h"}) == set()  # still leased
        beats.untrack("dec-h")  # scheduled: the pull starts
        consumer = Consumer(config(decode), d_cache)
        consumer.start(LoadSpec("dec-h", (9, 10, 11), params))
        assert pump(consumer) == ({"dec-h"}, set())
        block_dim = p_cache.layout.block_dims[0]
        assert torch.equal(pages(d_layers, [9, 10, 11], block_dim).view(torch.int16),
                           pages(p_layers, [2, 3, 4], block_dim).view(torch.int16))
        assert released(producer, "req-h")
        consumer.close()
    finally:
        beats.close()
        producer.close()


def test_heartbeats_renew_more_leases_than_one_call_may_name(sidecars):
    """A decode waiting on more leases of one prefill than a renew call may name renews them all,
    in several calls (one call of them all is refused whole)."""
    prefill, decode = sidecars
    prefill.client.create_region("hb-real-r0", 1, [16], "bfloat16")
    prefill.client.lease("hb-real-r0", 2)
    beats = Heartbeats(config(decode, lease_seconds=60, heartbeat_seconds=3600))
    try:
        for i in range(MAX_RENEW + 4):  # leases the prefill no longer holds, and its one held last
            beats.track(f"dec-hb-{i}", {"url": prefill.url, "lease": f"hb-gone-{i}", "ranks": 1})
        beats.track("dec-hb-real", {"url": prefill.url, "lease": "hb-real", "ranks": 1})
        beats.beat()
        assert beats.sent == 1
        assert prefill.client.leases()["leases"]["hb-real-r0"]["expires_in"] > 30
    finally:
        beats.close()
        prefill.client.delete_region("hb-real-r0")


def test_a_request_naming_more_ranks_than_its_prefill_runs_is_refused():
    """``ranks`` comes with the request: a count its prefill's record does not back, or past any
    tensor-parallel size, is refused before a lease name is made of it."""
    cfg = ConnectorConfig()
    params = remote_params("r", [1], cfg, compat=compat_record(tp=2))
    check_remote(params, cfg)
    unbacked = {key: value for key, value in params.items() if key != "compat"}
    for bad in ({**params, "ranks": 10 ** 12}, {**params, "ranks": 3}, {**params, "ranks": "all"},
                {**params, "ranks": 10 ** 12, "compat": {**params["compat"], "tp": 10 ** 12}},
                {**unbacked, "ranks": MAX_RANKS + 1}, {**unbacked, "ranks": 0}, {**params, "url": None}, "params"):
        with pytest.raises(RefusedPrefill):
            check_remote(bad, cfg)
    check_remote({**unbacked, "ranks": MAX_RANKS}, cfg)
    beats = Heartbeats(cfg)
    try:
        beats.track("dec-r", {**params, "ranks": 10 ** 12})
        assert beats._tracked == {}
    finally:
        beats.close()


def test_prefill_urls_name_the_sidecars_a_decode_may_call():
    listed = ConnectorConfig.load({"prefill_urls": "http://P1:7700/, https://p2"}, {})
    assert listed.prefill_urls == ("http://P1:7700/", "https://p2")
    assert ConnectorConfig.load({}, {"KVFERRY_CONNECTOR_PREFILL_URLS": "http://a:1 http://b:2"}).prefill_urls == (
        "http://a:1", "http://b:2")
    assert ConnectorConfig.load({"prefill_urls": ["http://a:1"]}, {}).prefill_urls == ("http://a:1",)
    assert listed.admits("http://p1:7700") and listed.admits("https://P2:443/v1") and listed.admits("HTTP://p1:7700")
    assert not any(listed.admits(url) for url in ("http://p1:7701", "https://p1:7700", "http://p2", "http://p1",
                                                  "http://p1.evil:7700", "p1:7700", ""))
    assert ConnectorConfig().admits("http://anywhere:1")  # not set: any
    with pytest.raises(ValueError, match="prefill_urls"):
        ConnectorConfig.load({"prefill_urls": "p1:7700"}, {})
    with pytest.raises(ValueError, match="prefill_urls"):
        ConnectorConfig.load({"prefill_urls": "198.18.0.0/33"}, {})
    pods = ConnectorConfig.load({"prefill_urls": "198.18.0.0/16, fd00::/8 http://p1:7700"}, {})  # pod networks
    assert all(pods.admits(url) for url in ("http://198.18.3.4:7700", "https://198.18.0.1", "http://[fd00::5]:7700",
                                            "http://p1:7700"))
    assert not any(pods.admits(url) for url in ("http://198.19.0.1:7700", "http://[fe80::1]:7700",
                                                "http://198.18.0.1.evil:7700", "http://p2:7700"))


def test_a_decode_sends_its_token_only_to_the_prefill_sidecars_it_lists(pd):
    """A request naming a sidecar ``prefill_urls`` does not list fails its load without any call
    there (its lease is left to expire); a listed one is pulled."""
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    producer = Producer(config(prefill), p_cache)
    elsewhere = Consumer(config(decode, prefill_urls=("http://127.0.0.1:1",)), d_cache)
    beats = Heartbeats(config(decode, prefill_urls=("http://127.0.0.1:1",)))
    try:
        producer.save("req-u", [1, 2])
        leased(producer, "req-u")
        params = remote_params("req-u", [1, 2], config(prefill))
        before = len(prefill.client.transfers(direction="out"))
        beats.track("dec-u", params)
        assert beats._tracked == {}
        pull = elsewhere.start(LoadSpec("dec-u", (3, 4), params))
        assert pump(elsewhere) == (set(), {"dec-u"})
        assert "prefill_urls" in pull.error and elsewhere.interval.data["failures"] == {"incompatible": 1}
        elsewhere.start(LoadSpec("dec-u2", (), params))  # nothing to pull: not even the lease's end is asked
        with pytest.raises(RefusedPrefill):
            elsewhere.remote(prefill.url)
        time.sleep(0.5)
        assert producer.finished_sending({"req-u"}) == set()  # the lease stands: nothing reached the prefill
        assert len(prefill.client.transfers(direction="out")) == before
        listed = Consumer(config(decode, prefill_urls=(prefill.url,)), d_cache)
        try:
            listed.start(LoadSpec("dec-u3", (3, 4), params))
            assert pump(listed) == ({"dec-u3"}, set())
            block_dim = p_cache.layout.block_dims[0]
            assert torch.equal(pages(d_layers, [3, 4], block_dim).view(torch.int16),
                               pages(p_layers, [1, 2], block_dim).view(torch.int16))
            assert released(producer, "req-u")
        finally:
            listed.close()
    finally:
        beats.close()
        elsewhere.close()
        producer.close()


def test_a_decode_without_prefill_urls_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(vllm_core, "_open_warned", type(vllm_core._open_warned)())
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        PeerClients(ConnectorConfig(prefill_urls=("http://p:1",), token="t"))
        PeerClients(ConnectorConfig())  # no token to send
        assert "prefill_urls is not set" not in caplog.text
        PeerClients(ConnectorConfig(token="t"))
        PeerClients(ConnectorConfig(token="t", remote_token="r"))
    assert caplog.text.count("prefill_urls is not set") == 1


def test_blocks_never_pulled_are_freed_after_the_ttl_even_if_renewed(pd):
    prefill, decode, p_cache, _, _, _ = pd
    producer = Producer(config(prefill, lease_seconds=60, lease_ttl=2), p_cache)
    beats = Heartbeats(config(decode, lease_seconds=60, heartbeat_seconds=0.2))
    try:
        producer.save("req-t", [5])
        leased(producer, "req-t")
        lease = producer.leases["req-t"].region
        beats.track("dec-t", remote_params("req-t", [5], config(prefill)))
        assert released(producer, "req-t", timeout=30)
        assert lease not in regions_of(prefill)
    finally:
        beats.close()
        producer.close()


def test_an_abort_frees_the_blocks_at_once(pd):
    """vLLM aborts a saved request: the lease ends now, not after lease_seconds or the TTL."""
    prefill, decode, p_cache, _, _, _ = pd
    producer = Producer(config(prefill, lease_seconds=300), p_cache)
    try:
        producer.save("req-a", [7, 8])
        leased(producer, "req-a")
        lease = producer.leases["req-a"].region
        assert lease in regions_of(prefill)
        producer.abandon(["req-a"])
        assert released(producer, "req-a", timeout=10)  # well before 300 s
        assert lease not in regions_of(prefill)
    finally:
        producer.close()


def test_a_held_lease_costs_a_call_per_change_not_a_poll_per_step(pd):
    """The prefill learns a lease's end by a long-poll: while one is held for a few seconds and
    vLLM steps as fast as it can, the sidecar answers a handful of calls, not hundreds."""
    prefill, decode, p_cache, d_cache, _, _ = pd

    def requests() -> float:
        text = prefill.client.metrics()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvferry_http_requests_total{"))

    producer = Producer(config(prefill, watch_seconds=1), p_cache)
    try:
        producer.save("req-p", [1])
        leased(producer, "req-p")
        before, steps = requests(), 0
        until = time.monotonic() + 3
        while time.monotonic() < until:
            assert producer.finished_sending(set()) == set()
            steps += 1
            time.sleep(0.001)
        calls = requests() - before - 1  # less this metrics call
        assert steps > 100 and calls <= 8, (steps, calls)
        consumer = Consumer(config(decode), d_cache)
        consumer.start(LoadSpec("dec-p", (3,), remote_params("req-p", [1], config(prefill))))
        assert pump(consumer)[0] == {"dec-p"}
        assert released(producer, "req-p")
        consumer.close()
    finally:
        producer.close()


def test_a_pull_of_nothing_ends_the_lease(pd):
    prefill, decode, p_cache, d_cache, _, _ = pd
    producer = Producer(config(prefill), p_cache)
    producer.save("req-3", [6])
    consumer = Consumer(config(decode), d_cache)
    consumer.start(LoadSpec("dec-3", (), remote_params("req-3", [6], config(prefill))))
    assert consumer.poll() == (set(), set())  # not a load vLLM waits for
    assert released(producer, "req-3")


def test_a_mirror_cuts_its_blocks_in_granules():
    layout = CacheLayout.of(vllm_layers(0), BLOCKS, heads=HEADS, block_size=BLOCK_SIZE)
    assert (layout.head_dim, layout.token_dim, layout.pieces, layout.granule) == (1, 2, 2, 16)
    assert layout.block_shape == (LAYERS, 2, 16, HEAD_DIM) and layout.planes == HEADS * 2
    # block 5, all heads: one run of heads x pieces; heads 1..2 of block 5: a run from head 1
    assert layout.blocks([5]) == packed([5 * HEADS * 2], HEADS * 2, 1)
    assert layout.blocks([5], first_head=1, count=2) == packed([(5 * HEADS + 1) * 2], 4, 1)
    # granule 11 is piece 1 of block 5: heads 1..2 of it lie a block's pieces apart
    assert layout.granules([11], first_head=1, count=2) == packed([(5 * HEADS + 1) * 2 + 1], 2, 2)
    whole = CacheLayout.of(vllm_layers(0), BLOCKS, heads=HEADS)  # no block size: whole pages
    assert (whole.pieces, whole.granule, whole.block_shape) == (1, None, (LAYERS, 2, BLOCK_SIZE, HEAD_DIM))
    with pytest.raises(IncompatibleCache, match="in_place: false"):
        whole.granules([1])


def test_granules_pair_blocks_of_different_sizes():
    # 140 tokens: the prefill's 5 blocks of 32; the decode's 2 fresh blocks of 64 after a local hit
    # of one (its 3 blocks hold tokens 0-191): granules 4 to 8 (tokens 64-143) are read
    pairs = pair_granules([9, 4], [7, 8, 3, 1, 2], tokens=140, block_sizes=(32, 64), granule=16)
    assert pairs.pieces == (2, 4)
    assert pairs.src == [3 * 2, 3 * 2 + 1, 1 * 2, 1 * 2 + 1, 2 * 2]
    assert pairs.dst == [9 * 4, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 4 * 4] and pairs.blocks == [9, 4]
    # the other way: 100 tokens from 2 prefill blocks of 64 into 4 decode blocks of 32
    pairs = pair_granules([1, 2, 3, 4], [5, 6], tokens=100, block_sizes=(64, 32), granule=16)
    assert pairs.src == [5 * 4 + g for g in range(4)] + [6 * 4 + g for g in range(3)]
    assert pairs.dst == [b * 2 + p for b in (1, 2, 3) for p in (0, 1)] + [4 * 2] and pairs.blocks == [1, 2, 3, 4]
    # two groups: blocks a window dropped (0) on either side are skipped
    pairs = pair_granules([[1, 2], [0, 3]], [[5, 6], [0, 7]], tokens=64, block_sizes=(32, 32 * 1), granule=16)
    assert pairs.dst == [2, 3, 4, 5, 6, 7] and pairs.src == [10, 11, 12, 13, 14, 15]
    with pytest.raises(IncompatibleCache, match="not the 200 tokens"):
        pair_granules([1, 2, 3, 4], [5, 6], tokens=200, block_sizes=(64, 64), granule=16)
    with pytest.raises(IncompatibleCache, match="multiples of 16"):
        pair_granules([1], [2], tokens=10, block_sizes=(24, 32), granule=16)


def prompt_tokens(layers: list[torch.Tensor], blocks: list[int], tokens: int) -> torch.Tensor:
    """A request's KV token by token (``[layers, 2, heads, tokens, head_dim]``) from its blocks of a
    kv-first cache, whatever its block size."""
    ids = torch.tensor(blocks)
    return torch.stack([t.index_select(1, ids).movedim(1, 2).flatten(2, 3)[:, :, :tokens] for t in layers])


@pytest.mark.parametrize("sizes", [(32, 64), (64, 16)], ids=["p32-d64", "p64-d16"])
def test_a_prefill_of_another_block_size_feeds_the_decode_token_for_token(sidecars, sizes):
    """The decode's blocks hold the prompt's tokens as the prefill's did, granule for granule,
    its other blocks and the tokens past the prompt untouched."""
    prefill, decode = sidecars
    (p_size, d_size), tokens = sizes, 150
    p_layers, d_layers = vllm_layers(3, block_size=p_size), vllm_layers(None, block_size=d_size)
    p_cache = KvCache(Client(prefill.url, token=TOKEN), f"p-bs{p_size}", p_layers, BLOCKS, heads=HEADS,
                      block_size=p_size)
    d_cache = KvCache(Client(decode.url, token=TOKEN), f"d-bs{d_size}", d_layers, BLOCKS, heads=HEADS,
                      block_size=d_size)
    request = f"req-bs{p_size}"
    try:
        src = [17, 2, 9, 4, 11, 0, 6, 21, 13, 8][:-(-tokens // p_size)]
        dst = [5, 14, 1, 20, 3, 12, 7, 22, 10, 15][:-(-tokens // d_size)]
        producer = Producer(config(prefill), p_cache)
        producer.save(request, src)
        params = remote_params(request, src, config(prefill), num_tokens=tokens,
                               compat=compat_record(block_size=p_size, kv_heads=HEADS))
        params["block_size"] = p_size
        consumer = Consumer(config(decode), d_cache, compat=compat_record(block_size=d_size, kv_heads=HEADS))
        pull = consumer.start(LoadSpec(f"dec-bs{p_size}", tuple(dst), params, tokens))
        assert pump(consumer) == ({f"dec-bs{p_size}"}, set()), pull.error
        got, sent = prompt_tokens(d_layers, dst, tokens), prompt_tokens(p_layers, src, tokens)
        assert torch.equal(got.view(torch.int16), sent.view(torch.int16))
        assert not pages(d_layers, [b for b in range(BLOCKS) if b not in dst], 1).any()
        granules = -(-tokens // 16) * 16
        assert not prompt_tokens(d_layers, dst, len(dst) * d_size)[:, :, :, granules:].any()
        assert released(producer, request)
    finally:
        p_cache.close()
        d_cache.close()


def test_different_block_sizes_are_refused_where_blocks_stay_whole(sidecars):
    """Pages registered whole (as a cache lent in place is) cannot be cut: the pull fails by name."""
    prefill, decode = sidecars
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-bs", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-bs", vllm_layers(None, block_size=16), BLOCKS)
    try:
        Producer(config(prefill), p_cache).save("req-4", [1])
        consumer = Consumer(config(decode), d_cache, compat=compat_record(block_size=16))
        params = remote_params("req-4", [1], config(prefill), num_tokens=20, compat=compat_record(block_size=32))
        params["block_size"] = 32
        pull = consumer.start(LoadSpec("dec-4", (2, 3), params, 20))
        assert pump(consumer) == (set(), {"dec-4"})
        assert "IncompatibleCache" in pull.error and "block" in pull.error and "in_place: false" in pull.error
    finally:
        p_cache.close()
        d_cache.close()


def test_prefill_sidecar_killed_fails_the_load_fast():
    prefill, decode = spawn("tcp"), spawn("tcp")
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-k", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-k", vllm_layers(None), BLOCKS)
    try:
        Producer(config(prefill), p_cache).save("req-5", list(range(12)))
        params = remote_params("req-5", list(range(12)), config(prefill))
        prefill.kill()
        consumer = Consumer(config(decode), d_cache)
        start = time.monotonic()
        pull = consumer.start(LoadSpec("dec-5", tuple(range(12, 24)), params))
        assert pump(consumer) == (set(), {"dec-5"})
        assert pull.error and "ConnectError" in pull.error
        assert consumer.interval.data["failures"] == {"unreachable": 1}
        assert time.monotonic() - start < 5
    finally:
        d_cache.close()
        stop(prefill, decode)


def test_a_prefill_sidecar_that_stops_after_a_pull_never_blocks_the_step():
    """The prefill's sidecar was met (its connections open) and then stops answering (SIGSTOP):
    the next pull is written from the step into a socket nobody reads, which never waits, and the
    load fails after load_timeout as a failed load."""
    import signal

    prefill, decode = spawn("tcp"), spawn("tcp")
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-st", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-st", vllm_layers(None), BLOCKS)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, load_timeout=3, call_timeout=2), d_cache)
    try:
        producer.save("req-met", [1, 2])
        leased(producer, "req-met")
        consumer.start(LoadSpec("dec-met", (3, 4), remote_params("req-met", [1, 2], config(prefill))))
        assert pump(consumer) == ({"dec-met"}, set())
        producer.save("req-st", [5, 6])
        leased(producer, "req-st")
        prefill.process.send_signal(signal.SIGSTOP)
        pull, outcome, longest = start_and_step(consumer, LoadSpec("dec-st", (7, 8), remote_params(
            "req-st", [5, 6], config(prefill))))
        assert outcome == (set(), {"dec-st"}), pull.error
        assert "ReadTimeout" in pull.error or "not done after 3 s" in pull.error
        assert longest < 0.5, longest  # the step never waited on the stopped sidecar
    finally:
        prefill.process.send_signal(signal.SIGCONT)
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_leases_end_when_the_local_sidecar_dies():
    """The prefill's own sidecar dies with leases held (its regions die with it): the blocks go
    back to vLLM after lease_seconds, not after the TTL."""
    prefill = spawn("tcp")
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-x", vllm_layers(1), BLOCKS)
    producer = Producer(config(prefill, lease_seconds=2, call_timeout=2), p_cache)
    try:
        producer.save("req-x", [1, 2])
        leased(producer, "req-x")
        prefill.kill()
        assert released(producer, "req-x", timeout=60)
    finally:
        producer.close()
        p_cache.client.close()
        p_cache._shm.close()
        p_cache._shm.unlink()
        stop(prefill)


def _restartable():
    """Starts a sidecar on the same two ports each time it is called: a restart, as a pod's."""
    ports = (free_port(), free_port())

    def start():
        log = log_path(ports[0])
        process = start_sidecar(*ports, "tcp", token=TOKEN, env={"KVFERRY_TRANSFER_TIMEOUT": "10"}, log=log)
        return ready(f"http://127.0.0.1:{ports[0]}", process, log)

    return start


def test_leases_end_when_the_local_sidecar_restarts():
    """The prefill's own sidecar restarts (its regions gone, its lease book's generation from 0
    again): the leases it held end at once, not once the new book's generation passes theirs."""
    start = _restartable()
    prefill = start()
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-rs", vllm_layers(1), BLOCKS)
    producer = Producer(config(prefill, lease_seconds=120, watch_seconds=1), p_cache)
    try:
        for i in range(3):
            producer.save(f"req-rs{i}", [i + 1])
            leased(producer, f"req-rs{i}")
        prefill.kill()
        prefill = start()
        for i in range(3):
            assert released(producer, f"req-rs{i}", timeout=20)
    finally:
        producer.close()
        p_cache.client.close()
        p_cache._shm.close()
        p_cache._shm.unlink()
        stop(prefill)


def test_a_decode_whose_sidecar_restarted_registers_its_cache_again():
    """The decode's own sidecar restarts (its regions gone): the pull that finds its cache region
    missing fails, and the cache is registered again, so the next pull loads, bit-exact."""
    start = _restartable()
    prefill, decode = spawn("tcp"), start()
    p_layers, d_layers = vllm_layers(1), vllm_layers(None)
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-drs", p_layers, BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-drs", d_layers, BLOCKS)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, codec="raw"), d_cache)

    def pull(request: str, src: list[int], dst: tuple[int, ...]) -> tuple[set[str], set[str]]:
        producer.save(request, src)
        leased(producer, request)
        consumer.start(LoadSpec(f"dec-{request}", dst, remote_params(request, src, config(prefill))))
        return pump(consumer, timeout=30)

    try:
        assert pull("a", [1, 2], (3, 4)) == ({"dec-a"}, set())
        decode.kill()
        decode = start()
        assert pull("b", [5, 6], (7, 8)) == (set(), {"dec-b"})  # its region was gone: nothing written
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "d-drs" not in regions_of(decode):
            time.sleep(0.1)
        assert pull("c", [9, 10], (11, 12)) == ({"dec-c"}, set())
        got, want = torch.stack(d_layers), torch.stack(p_layers)
        assert torch.equal(got[:, :, [11, 12]].view(torch.int16), want[:, :, [9, 10]].view(torch.int16))
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_kv_corrupted_on_the_wire_fails_the_load():
    prefill = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "5"}, corrupt_chunk=0)
    decode = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "5"})
    p_layers, d_layers = vllm_layers(1), vllm_layers(None)
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-c", p_layers, BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-c", d_layers, BLOCKS)
    try:
        producer = Producer(config(prefill), p_cache)
        producer.save("req-6", list(range(12)))
        consumer = Consumer(config(decode, codec="raw"), d_cache)
        pull = consumer.start(LoadSpec("dec-6", tuple(range(12, 24)), remote_params("req-6", list(range(12)), config(prefill))))
        assert pull.error is None
        assert pump(consumer) == (set(), {"dec-6"})
        # Reported once the decode's own sidecar answered a cancel: nothing of it writes any more.
        assert pull.stopping is not None and pull.stopping.done()
        assert consumer.failed_blocks["dec-6"] == tuple(range(12, 24))
        # The failed blocks' contents are vLLM's to recompute; no other block may be touched.
        assert not torch.stack(d_layers)[:, :, :12].any()
        assert released(producer, "req-6")  # the decode released the lease anyway
    finally:
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_a_transfer_the_decode_sidecar_failed_fails_the_load_while_the_sender_still_runs():
    """The decode's own sidecar gives up on a chunk that does not come (its transfer_timeout, 1 s)
    while the prefill's sidecar is still sending it (a link paced to 100 kB/s, so its record stays
    running for seconds more): the pull fails then, with the receiver's reason, well within
    load_timeout, rather than waiting for the sender and failing as a timeout."""
    prefill = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "30", "KVFERRY_EMULATED_LINK_GBPS": "0.0001"})
    decode = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "1"})
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-s", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-s", vllm_layers(None), BLOCKS)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, codec="raw", load_timeout=8), d_cache)
    try:
        producer.save("req-s", list(range(12)))
        leased(producer, "req-s")
        start = time.monotonic()
        pull = consumer.start(LoadSpec("dec-s", tuple(range(12, 24)), remote_params("req-s", list(range(12)),
                                                                                     config(prefill))))
        assert pump(consumer, timeout=15) == (set(), {"dec-s"})
        elapsed = time.monotonic() - start
        sender = prefill.client.transfer(pull.transfer_id)
        assert sender["state"] == "running", sender  # the sender had not ended: the receiver's word decided
        assert "no data for 1 s" in pull.error or "under the floor" in pull.error, pull.error
        assert elapsed < 5, f"{elapsed:.1f} s: the pull waited for the sender"
        prefill.client.cancel(pull.transfer_id)  # no paced send left for the shutdown to wait out
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_a_pull_past_load_timeout_is_reported_failed_once_the_decode_sidecar_stopped_it():
    """A pull still moving at load_timeout (a link paced to 12.5 kB/s): vLLM may give its blocks to
    another request as soon as the failure is reported, so it is reported only once the decode's
    own sidecar has ended the transfer (cancelled, its sender told), never while it still writes."""
    prefill = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "60", "KVFERRY_EMULATED_LINK_GBPS": "0.0001"})
    decode = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "60"})
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-lt", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-lt", vllm_layers(None), BLOCKS)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, codec="raw", load_timeout=2, call_timeout=5), d_cache)
    try:
        producer.save("req-lt", list(range(12)))
        leased(producer, "req-lt")
        pull = consumer.start(LoadSpec("dec-lt", tuple(range(12, 24)), remote_params("req-lt", list(range(12)),
                                                                                    config(prefill))))
        assert pump(consumer, timeout=30) == (set(), {"dec-lt"})
        assert "not done after 2 s" in pull.error, pull.error
        receiver = decode.client.transfer(pull.transfer_id)
        assert receiver["state"] == "cancelled", receiver
        deadline = time.monotonic() + 10
        while (sender := prefill.client.transfer(pull.transfer_id))["state"] == "running" \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender["state"] == "cancelled", sender  # told by the decode's sidecar
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_a_lease_that_cannot_be_taken_frees_the_blocks_at_once():
    prefill = spawn("tcp")
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-d", vllm_layers(1), BLOCKS)
    producer = Producer(config(prefill, call_timeout=2), p_cache)
    prefill.kill()
    try:
        producer.save("req-7", [1, 2])
        assert released(producer, "req-7")
        producer.close()
    finally:
        p_cache.client.close()
        p_cache._shm.close()
        p_cache._shm.unlink()
        stop(prefill)


@pytest.fixture
def stalled():
    """A control API that accepts connections and never answers (a host that drops packets
    after the handshake): a real listening socket whose connections are held open, unread."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop_ = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop_.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop_.set()
    thread.join()
    for sock in held:
        sock.close()
    server.close()


def test_a_stalled_prefill_sidecar_never_blocks_the_decode_step(pd, stalled):
    """Every call to the prefill's sidecar hangs: vLLM's step (start, then poll every step) goes
    on at once, and the load fails after load_timeout as a failed load."""
    _, decode, _, d_cache, _, d_layers = pd
    consumer = Consumer(config(decode, load_timeout=3, call_timeout=2), d_cache)
    params = {"url": stalled, "lease": lease_name("vllm-kv", "req-s"), "block_ids": [1, 2], "num_tokens": 64}
    pull, outcome, longest = start_and_step(consumer, LoadSpec("dec-s", (3, 4), params))
    assert outcome == (set(), {"dec-s"})
    assert "ReadTimeout" in pull.error or "not done after 3 s" in pull.error  # whichever deadline came first
    assert longest < 0.5, longest  # a step never waited on the stalled sidecar (its calls wait seconds)
    assert consumer.interval.data["failures"] == {"timeout": 1}
    assert not torch.stack(d_layers).any()
    consumer.close()


def test_a_stalled_local_sidecar_never_blocks_the_prefill_step(stalled):
    """The prefill's own sidecar hangs: saving, aborting and asking for finished requests go on at
    once; the lease that could not be taken frees its blocks once its call timed out."""
    cache = KvCache.__new__(KvCache)  # the cache's registration would hang too: a mirror in memory
    cache.layout = CacheLayout.of(vllm_layers(1), BLOCKS)
    cache.layers, cache.device, cache.name = vllm_layers(1), torch.device("cpu"), "p-stalled"
    cache.mirror = torch.zeros((BLOCKS, cache.layout.heads, cache.layout.pieces, *cache.layout.block_shape),
                               dtype=torch.bfloat16)
    cache.client = Client(stalled, token=TOKEN, timeout=2)
    cache._create = lambda name: cache.client.create_region(name, BLOCKS, list(cache.layout.block_shape), "bfloat16")
    producer = Producer(ConnectorConfig(url=stalled, token=TOKEN, call_timeout=2), cache)
    try:
        longest, began = 0.0, time.monotonic()
        producer.save("req-s1", [1, 2])
        producer.save("req-s2", [3])
        producer.abandon(["req-s2"])
        longest = time.monotonic() - began
        done: set[str] = set()
        while done != {"req-s1", "req-s2"}:
            assert time.monotonic() - began < 60, "the leases were never given up"
            step = time.monotonic()
            done |= producer.finished_sending({"req-s1"})
            longest = max(longest, time.monotonic() - step)
            time.sleep(0.005)
        assert longest < 0.5, longest
        assert torch.equal(cache.mirror[[1, 2], 0, 0, 0], torch.stack(cache.layers)[0].movedim(1, 0)[[1, 2]])
    finally:
        producer.close()
        cache.client.close()


def test_a_prefill_that_differs_is_refused_by_name_before_any_transfer(pd):
    prefill, decode, p_cache, d_cache, _, d_layers = pd
    theirs = compat_record(model="org/model-a", dtype="bfloat16", kv_cache_dtype="auto", block_size=32, tp=2)
    ours = compat_record(model="org/model-b", dtype="bfloat16", kv_cache_dtype="auto", block_size=24, tp=1)
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache, compat=ours)
    try:
        before = len(prefill.client.transfers(direction="out"))
        producer.save("req-c", [1])
        pull = consumer.start(LoadSpec("dec-c", (2,), remote_params("req-c", [1], config(prefill), compat=theirs)))
        assert pump(consumer) == (set(), {"dec-c"})
        assert "IncompatiblePeer" in pull.error
        for differs in ("model: prefill 'org/model-a', decode 'org/model-b'", "block_size: prefill 32, decode 24",
                        "tp: prefill 2, decode 1"):
            assert differs in pull.error
        assert "dtype" not in pull.error.replace("kv_cache_dtype", "")  # only what differs is named
        pull = consumer.start(LoadSpec("dec-c2", (2,), remote_params("req-c", [1], config(prefill))))
        assert pump(consumer) == (set(), {"dec-c2"})
        assert "no compatibility record" in pull.error
        assert len(prefill.client.transfers(direction="out")) == before  # nothing was sent
        assert consumer.interval.data["failures"] == {"incompatible": 2}
        assert not torch.stack(d_layers).any()
        assert released(producer, "req-c")  # the refused pull still ends the lease
        # the same record passes, and the kvferry and protocol versions are part of it
        same = dict(ours)
        consumer.start(LoadSpec("dec-c3", (2,), {**remote_params("req-c3", [1], config(prefill)), "compat": same}))
        assert set(ours) >= {"kvferry", "peer_protocol", "model", "dtype", "block_size", "tp", "pp", "dp"}
    finally:
        consumer.close()
        producer.close()


def exposition(stats_data: dict, engines: dict[int, list[object]] | None = None) -> dict:
    """Feed statistics through PromMetrics into a registry of its own; the parsed exposition as
    {(name, labels): value}."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvferry.client.vllm_core import PromMetrics

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    engines = engines or {0: ["m", "0"]}
    metrics = PromMetrics(types, ["model_name", "engine"], engines)
    for idx in engines:
        metrics.observe(stats_data, idx)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_statistics_in_the_prometheus_exposition():
    from kvferry.client.vllm_core import TransferStats

    a, b = TransferStats(), TransferStats()
    a.record({"transfer_seconds": 0.004, "wait_seconds": 0.006, "bytes_raw": 4000, "bytes_wire": 2500,
              "codec": "splitzip"})
    b.record({"transfer_seconds": 0.02, "wait_seconds": 0.03, "bytes_raw": 1000, "bytes_wire": 1000, "codec": "raw"})
    b.record({"transfer_seconds": 0.3, "wait_seconds": 0.4, "bytes_raw": 6000, "bytes_wire": 3000, "codec": "splitzip"})
    b.fail("timeout")
    b.fail("timeout")
    b.fail("incompatible")
    total = TransferStats(dict(a.data)).aggregate(b)  # as vLLM sums the workers'
    assert total.reduce() == {"requests": 3, "failures": 3, "avg_transfer_ms": 108.0, "p90_transfer_ms": 300.0,
                              "avg_wait_ms": 145.333, "bytes_raw": 11000, "bytes_wire": 6500, "ratio": 1.692}
    samples = exposition(total.data)
    eng = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:kvferry_bytes_raw_total", tuple(sorted((*eng, ("codec", "splitzip")))))] == 10000
    assert samples[("vllm:kvferry_bytes_wire_total", tuple(sorted((*eng, ("codec", "splitzip")))))] == 5500
    assert samples[("vllm:kvferry_bytes_wire_total", tuple(sorted((*eng, ("codec", "raw")))))] == 1000
    assert samples[("vllm:kvferry_requests_total", tuple(sorted((*eng, ("codec", "splitzip")))))] == 2
    assert samples[("vllm:kvferry_failures_total", tuple(sorted((*eng, ("kind", "timeout")))))] == 2
    assert samples[("vllm:kvferry_failures_total", tuple(sorted((*eng, ("kind", "incompatible")))))] == 1
    assert samples[("vllm:kvferry_transfer_seconds_count", eng)] == 3
    assert samples[("vllm:kvferry_transfer_seconds_sum", eng)] == pytest.approx(0.324)
    assert samples[("vllm:kvferry_transfer_seconds_bucket", tuple(sorted((*eng, ("le", "0.005")))))] == 1
    assert samples[("vllm:kvferry_transfer_seconds_bucket", tuple(sorted((*eng, ("le", "0.25")))))] == 2
    assert samples[("vllm:kvferry_wait_seconds_sum", eng)] == pytest.approx(0.436)
    assert samples[("vllm:kvferry_ratio_sum", tuple(sorted((*eng, ("codec", "splitzip")))))] == pytest.approx(1.6 + 2)
    assert not TransferStats().take() and TransferStats().is_empty()
    taken = total.take()
    assert taken is not None and taken.reduce()["requests"] == 3 and total.is_empty()
    # two engines: each its own children
    two = exposition(b.data, {0: ["m", "0"], 1: ["m", "1"]})
    assert two[("vllm:kvferry_failures_total", (("engine", "1"), ("kind", "timeout"), ("model_name", "m")))] == 2


def test_a_real_pull_shows_in_the_statistics(pd):
    prefill, decode, p_cache, d_cache, _, _ = pd
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, codec="splitzip"), d_cache)
    try:
        producer.save("req-m", [1, 2, 3])
        consumer.start(LoadSpec("dec-m", (4, 5, 6), remote_params("req-m", [1, 2, 3], config(prefill))))
        assert pump(consumer) == ({"dec-m"}, set())
        record = prefill.client.wait(prefill.client.transfers(direction="out")[0]["id"], timeout=30)
        stats = consumer.interval.take()
        assert stats is not None and consumer.interval.is_empty()
        samples = exposition(stats.data)
        labels = (("codec", "splitzip"), ("engine", "0"), ("model_name", "m"))
        assert samples[("vllm:kvferry_bytes_raw_total", labels)] == record["bytes_raw"] > 0
        assert samples[("vllm:kvferry_bytes_wire_total", labels)] == record["bytes_wire"] > 0
        arrived = decode.client.transfers(direction="in")[0]  # the end is this decode's sidecar's record
        assert arrived["id"] == record["id"] and arrived["state"] == "done"
        assert samples[("vllm:kvferry_transfer_seconds_sum", (("engine", "0"), ("model_name", "m")))] == \
            pytest.approx(arrived["seconds"])
    finally:
        consumer.close()
        producer.close()


def test_a_lease_of_a_view_shares_the_cache_and_holds_it(sidecars):
    """A lease taken ``of`` a registered region is a new name over the same memory (what a
    transfer reads through the view is the base's), taken and extended in one call; the base
    is not deleted while a view of it exists, and bad views are refused by name."""
    from kvferry.engine.errors import BadRequest, Conflict, NotFound

    prefill, decode = sidecars
    c = prefill.client
    base = torch.arange(4 * 64, dtype=torch.int16).view(4, 64)  # the bits of bfloat16 blocks
    c.create_region("view-base", 4, [64], "bfloat16")
    for i in range(4):
        c.put_block("view-base", i, base[i].numpy().tobytes())
    assert c.lease("view-a", 30, ttl=60, of="view-base")["name"] == "view-a"
    assert c.lease("view-a", 40, of="view-base")["expires_in"] == pytest.approx(40, abs=1)  # extended
    assert c.region("view-a")["view_of"] == "view-base" and c.region("view-base")["view_of"] is None
    assert c.get_block("view-a", 2) == base[2].numpy().tobytes()
    decode.client.create_region("view-dst", 4, [64], "bfloat16")
    record = c._call("POST", "/v1/transfers", params={"wait": 30}, json={
        "src_region": "view-a", "src_blocks": [3, 1], "dst_region": "view-dst", "dst_blocks": [0, 2],
        "peer": decode.client.data_address(), "codec": "raw"}).json()
    assert record["state"] == "done", record
    assert decode.client.get_block("view-dst", 0) == base[3].numpy().tobytes()
    assert decode.client.get_block("view-dst", 2) == base[1].numpy().tobytes()
    with pytest.raises(Conflict, match="view-a"):
        c.delete_region("view-base")
    with pytest.raises(NotFound):
        c.lease("view-b", 5, of="view-none")
    with pytest.raises(BadRequest, match="view of"):
        c.lease("view-c", 5, of="view-a")
    c.create_region("view-own", 1, [64], "bfloat16")
    with pytest.raises(Conflict, match="not a view"):
        c.lease("view-own", 5, of="view-base")
    c.delete_region("view-a")
    assert "view-a" not in c.leases()["leases"]
    c.delete_region("view-base")
    for name in ("view-own",):
        c.delete_region(name)
    decode.client.delete_region("view-dst")


def test_the_receiver_answers_a_transfer_it_is_about_to_get(sidecars):
    """``appear``: a decode's own sidecar waits for a transfer a prefill announces to it and
    answers at its end there; one that does not come is NotFound after ``appear``, not ``wait``."""
    from kvferry.engine.errors import BadRequest, NotFound

    prefill, decode = sidecars
    prefill.client.create_region("appear-src", 4, [64], "bfloat16")
    decode.client.create_region("appear-dst", 4, [64], "bfloat16")
    began = time.monotonic()
    with pytest.raises(NotFound, match="none came within 0.2 s"):
        decode.client.transfer("0123456789abcdef0123456789abcdef", wait=10, appear=0.2)
    assert time.monotonic() - began < 5
    for appear in (-1, 5.5):  # 0 to 5 s
        with pytest.raises(BadRequest, match="422"):
            decode.client._call("GET", "/v1/transfers/x", params={"wait": 1, "appear": appear})
    record = prefill.client._call("POST", "/v1/transfers", params={"wait": 0}, json={
        "src_region": "appear-src", "src_blocks": [0, 1], "dst_region": "appear-dst", "dst_blocks": [2, 3],
        "peer": decode.client.data_address(), "codec": "raw"}).json()
    arrived = decode.client.transfer(record["id"], wait=30, appear=5)
    assert arrived["id"] == record["id"] and arrived["state"] == "done" and arrived["direction"] == "in"
    assert prefill.client.transfer(record["id"], wait=30)["state"] == "done"  # its DONE may still be on the way
    for client, name in ((prefill.client, "appear-src"), (decode.client, "appear-dst")):
        client.delete_region(name)


def test_the_sidecars_lease_book(sidecars):
    """The API under the connector's leases: take, renew (a heartbeat names leases gone as
    missing), the TTL caps renewals, the long-poll answers when a lease ends, bad input is refused."""
    import threading

    from kvferry.engine.errors import EngineError, NotFound

    prefill, _ = sidecars
    c = prefill.client
    c.create_region("book-a", 2, [4], "bfloat16")
    taken = c.lease("book-a", 30, ttl=60)
    assert taken["expires_in"] == pytest.approx(30, abs=1) and taken["ends_in"] == pytest.approx(60, abs=1)
    assert c.renew_leases(["book-a", "book-none"], 300) == {"renewed": ["book-a"], "missing": ["book-none"]}
    assert c.leases()["leases"]["book-a"]["expires_in"] <= 60  # never renewed past the TTL
    with pytest.raises(NotFound):
        c.lease("book-none", 5)
    with pytest.raises(EngineError, match="422"):
        c.lease("book-a", 0)
    generation = c.leases()["generation"]
    threading.Timer(0.5, c.delete_region, ("book-a",)).start()
    began = time.monotonic()
    book = c.leases(after=generation, wait=20)
    assert "book-a" not in book["leases"] and book["generation"] > generation
    assert time.monotonic() - began < 15  # answered by the deletion, not by the deadline
    assert c.leases(after=book["generation"], wait=0.2)["generation"] == book["generation"]  # nothing changed


def test_a_release_waits_out_the_transfer_still_holding_its_lease():
    """The decode learns the KV arrived before the prefill's sidecar hears the DONE that ends the
    transfer there: deleting the lease meanwhile is refused (in use), and asked again, so the
    prefill's blocks are not held until the lease expires. (A stub: the window is a few hundred
    microseconds, too short to hit on purpose.)"""
    from kvferry.client.vllm_core import release
    from kvferry.engine.errors import Conflict

    class Sidecar:
        def __init__(self, refusals: int):
            self.refusals, self.calls = refusals, 0

        def delete_region(self, name: str) -> None:
            self.calls += 1
            if self.calls <= self.refusals:
                raise Conflict(f"region {name!r} is in use by transfers ['t']")

    busy = Sidecar(refusals=3)
    release(busy, "lease-a")
    assert busy.calls == 4
