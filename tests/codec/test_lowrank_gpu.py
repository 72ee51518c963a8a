"""The lowrank Triton kernels on a GPU against the CPU reference: the same frame bytes and the
same reconstructed bits, both ways. Skipped without CUDA and Triton."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from kvferry.codec import lowrank
from kvferry.codec.layout import BlockLayout
from kvferry.codec.lowrank import gpu
from tests.codec.test_lowrank import AXES, as_blocks, kv_chunk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and Triton")]


@pytest.mark.parametrize("quantize", [None, "k8v4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("energy", [0.9, 0.99, 1.0])
def test_gpu_bytes_and_values_equal_cpu(real_kv, dtype, quantize, energy):
    book = lowrank.calibrate(kv_chunk(real_kv, 0).to(dtype), axes=AXES, energy=energy, quantize=quantize)
    x = as_blocks(kv_chunk(real_kv, 1).to(dtype), 73)
    bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
    cpu = lowrank.encode(x, bound)
    dev = lowrank.encode(x.cuda(), bound)
    assert dev.is_cuda and torch.equal(dev.cpu(), cpu), "GPU frame != CPU frame"
    y_cpu = lowrank.decode(cpu, bound)
    y_dev = lowrank.decode(cpu.cuda(), bound)
    assert y_dev.is_cuda and torch.equal(y_dev.cpu().view(torch.int16), y_cpu.view(torch.int16))
    cache = torch.zeros_like(x).cuda()
    ids = torch.arange(x.shape[0] - 1, -1, -1)
    lowrank.decode_blocks(lowrank.encode_blocks(x.cuda(), ids.cuda(), bound), cache, ids.cuda(), bound)
    assert torch.equal(cache.cpu().view(torch.int16), y_cpu.view(torch.int16))


def test_gpu_decode_writes_nothing_on_a_bad_frame(real_kv):
    book = lowrank.calibrate(kv_chunk(real_kv, 0, 2), axes=AXES, energy=0.9)
    x = as_blocks(kv_chunk(real_kv, 1, 2), 73).cuda()
    bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
    frame = lowrank.encode(x, bound)
    frame[frame.numel() // 2] ^= 1
    cache = torch.zeros_like(x)
    with pytest.raises(codec.CorruptFrame):
        lowrank.decode_blocks(frame, cache, torch.arange(x.shape[0]), bound)
    assert not cache.view(torch.int16).any()
