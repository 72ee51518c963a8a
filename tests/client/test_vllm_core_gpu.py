"""The connector's core on a GPU, without vLLM: two GPU sidecars, vLLM-shaped caches on the GPU
(layers end to end in one buffer, as vLLM allocates them) lent in place, and the same through a
device mirror. Skipped without CUDA and CuPy."""

from __future__ import annotations

import time

import pytest
import torch

from kvferry.client import Client
from kvferry.client.vllm_core import ConnectorConfig, Consumer, KvCache, LoadSpec, Producer, remote_params
from kvferry.engine import ipc

from .conftest import TOKEN, spawn, stop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ipc.available(), reason="needs a CUDA GPU and CuPy")]

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 24, 2, 16, 64


def _layers(seed: int | None) -> list[torch.Tensor]:
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return list(torch.zeros(shape, dtype=torch.bfloat16, device="cuda").unbind(0))
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return list((torch.randn(shape, generator=generator, device="cuda") * 0.7).to(torch.bfloat16).unbind(0))


def _pages(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    index = torch.tensor(ids, device="cuda")
    return torch.stack([t.index_select(1, index) for t in layers]).view(torch.int16)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("codec", ["raw", "splitzip"])
def test_request_kv_lands_in_the_decodes_cache(in_place, codec):
    env = {"KVFERRY_TRANSFER_TIMEOUT": "20"}
    prefill, decode = spawn("tcp", env, device="cuda"), spawn("tcp", env, device="cuda")
    p_layers, d_layers = _layers(1), _layers(None)
    p_cache = KvCache(Client(prefill.url, token=TOKEN), "p", p_layers, BLOCKS, in_place=in_place)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d", d_layers, BLOCKS, in_place=in_place)
    try:
        assert p_cache.layout.in_place == d_cache.layout.in_place == in_place
        assert (p_cache.mirror is None) == in_place
        p_config = ConnectorConfig(url=prefill.url, token=TOKEN, codec=codec)
        producer = Producer(p_config, p_cache)
        consumer = Consumer(ConnectorConfig(url=decode.url, token=TOKEN, codec=codec), d_cache)
        src, dst = [3, 9, 4, 17, 0], [20, 1, 2, 11, 5]
        producer.save("req-1", src)
        torch.cuda.synchronize()
        pull = consumer.start(LoadSpec("dec-1", tuple(dst), remote_params("req-1", src, p_config)))
        assert pull.error is None, pull.error
        deadline = time.monotonic() + 30
        received: set[str] = set()
        while not received and time.monotonic() < deadline:
            received, failed = consumer.poll()
            assert not failed, consumer.failed_blocks
            time.sleep(0.002)
        assert received == {"dec-1"}
        torch.cuda.synchronize()
        assert torch.equal(_pages(d_layers, dst), _pages(p_layers, src))
        others = [b for b in range(BLOCKS) if b not in dst]
        assert not _pages(d_layers, others).any()  # nothing else written
        assert consumer.stats[-1]["codec"] == codec and consumer.stats[-1]["load_seconds"] >= 0
        consumer.close()
    finally:
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)
