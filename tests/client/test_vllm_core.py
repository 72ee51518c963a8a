"""The connector's core against real sidecars, without vLLM: vLLM-shaped per-layer KV tensors on
two 'workers', the hook sequence of a P/D request replayed (save + lease on the prefill, pull +
load + release on the decode), and what must happen when the lease lapses, the layouts differ,
the prefill's sidecar dies or the KV is corrupted on the wire."""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import replace

import pytest
import torch

from kvferry.client import Client, packed
from kvferry.client.vllm_core import (
    CacheLayout,
    ConnectorConfig,
    Consumer,
    IncompatibleCache,
    KvCache,
    LoadSpec,
    Producer,
    lease_name,
    match_blocks,
    remote_params,
)

from .conftest import TOKEN, spawn, stop

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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    with pytest.raises(IncompatibleCache, match="block size, head layout"):
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
    assert outgoing[0]["chosen_codec"] == consumer.stats[-1]["codec"] and outgoing[0]["state"] == "done"
    if codec != "auto":
        assert outgoing[0]["chosen_codec"] == codec
    assert consumer.stats[-1]["wait_seconds"] >= consumer.stats[-1]["transfer_seconds"] > 0

    # the decode deletes the lease; the prefill frees the blocks once vLLM has finished the request
    assert producer.finished_sending(set()) == set()
    assert released(producer, "req-1")
    assert producer.leases == {}


def test_poll_asks_nobody_while_a_pull_is_on_its_way(pd):
    """vLLM calls get_finished every step: a pull's end is awaited by a long-poll on a worker
    thread, so poll() makes no HTTP request until the transfer has ended."""
    prefill, decode, p_cache, d_cache, p_layers, d_layers = pd
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, codec="splitzip"), d_cache)
    producer.save("req-w", [2, 3])
    pull = consumer.start(LoadSpec("dec-w", (7, 8), remote_params("req-w", [2, 3], config(prefill))))
    assert pull.error is None and pull.ended is not None
    asked = []
    real = pull.client.transfer
    pull.client.transfer = lambda *a, **k: asked.append(a) or real(*a, **k)
    assert pump(consumer) == ({"dec-w"}, set())
    assert asked == []  # the waiter thread's own client told it
    block_dim = p_cache.layout.block_dims[0]
    assert torch.equal(pages(d_layers, [7, 8], block_dim).view(torch.int16),
                       pages(p_layers, [2, 3], block_dim).view(torch.int16))
    consumer.close()


def test_lease_lapses_and_a_late_pull_fails(pd):
    prefill, decode, p_cache, d_cache, _, d_layers = pd
    clock = Clock()
    producer = Producer(config(prefill, lease_seconds=5), p_cache, clock=clock)
    producer.save("req-2", [1, 2])
    assert producer.finished_sending({"req-2"}) == set()
    clock.now += 6
    assert producer.finished_sending(set()) == {"req-2"}  # never stranded
    consumer = Consumer(config(decode), d_cache)
    pull = consumer.start(LoadSpec("dec-2", (4, 5), remote_params("req-2", [1, 2], config(prefill))))
    assert "NotFound" in pull.error  # the blocks may be reused already: nothing is read
    assert consumer.poll() == (set(), {"dec-2"})
    assert consumer.failed_blocks["dec-2"] == (4, 5)
    assert not torch.stack(d_layers).any()


def test_a_pull_of_nothing_ends_the_lease(pd):
    prefill, decode, p_cache, d_cache, _, _ = pd
    producer = Producer(config(prefill), p_cache)
    producer.save("req-3", [6])
    consumer = Consumer(config(decode), d_cache)
    consumer.start(LoadSpec("dec-3", (), remote_params("req-3", [6], config(prefill))))
    assert consumer.poll() == (set(), set())  # not a load vLLM waits for
    assert released(producer, "req-3")


def test_different_block_size_is_refused_at_the_first_transfer(sidecars):
    prefill, decode = sidecars
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-bs", vllm_layers(1), BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-bs", vllm_layers(None, block_size=16), BLOCKS)
    try:
        Producer(config(prefill), p_cache).save("req-4", [1])
        consumer = Consumer(config(decode), d_cache)
        pull = consumer.start(LoadSpec("dec-4", (2,), remote_params("req-4", [1], config(prefill))))
        assert "IncompatibleCache" in pull.error and "block size" in pull.error
        assert consumer.poll() == (set(), {"dec-4"})
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
        assert pull.error and "ConnectError" in pull.error
        assert consumer.poll() == (set(), {"dec-5"})
        assert time.monotonic() - start < 5
    finally:
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
        assert consumer.failed_blocks["dec-6"] == tuple(range(12, 24))
        # The failed blocks' contents are vLLM's to recompute; no other block may be touched.
        assert not torch.stack(d_layers)[:, :, :12].any()
        assert released(producer, "req-6")  # the decode released the lease anyway
    finally:
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def test_a_lease_that_cannot_be_taken_frees_the_blocks_at_once():
    prefill = spawn("tcp")
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-d", vllm_layers(1), BLOCKS)
    producer = Producer(config(prefill), p_cache)
    prefill.kill()
    try:
        lease = producer.save("req-7", [1, 2])
        assert not lease.held
        assert producer.finished_sending({"req-7"}) == {"req-7"}
    finally:
        p_cache.client.close()
        p_cache._shm.close()
        p_cache._shm.unlink()
        stop(prefill)
