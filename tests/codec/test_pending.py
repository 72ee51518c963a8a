"""Codec work launched without waiting (``start_encode_blocks`` / ``start_decode_blocks``): the
same bytes and the same refusals as the calls that wait, on the GPU and, where they simply run
the waiting call, on the CPU."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec as codecs
from kvferry.codec.staging import Pending

LAUNCHING = [name for name in codecs.names() if codecs.get(name).capabilities.starts_blocks]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cache(device: str, blocks: int = 12, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    x = torch.randn(blocks, 16, 8, 64, generator=torch.Generator().manual_seed(blocks)) * 0.05
    return x.to(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(codecs.layout_for(t.dtype).int_dtype).cpu()


def test_pending_runs_its_steps_once_asked():
    steps = []
    pending = Pending.done(3).then(lambda v: steps.append(v) or v + 1)
    assert pending.ready() and steps == []
    assert pending.result() == 4 and steps == [3]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("name", LAUNCHING)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # coded, and stored by SplitZip
def test_launched_coding_writes_the_bytes_of_the_waiting_calls(device, name, dtype):
    codec = codecs.get(name)
    cache = _cache(device, dtype=dtype)
    ids = torch.tensor([7, 2, 11, 0, 5], device=device)
    book = codec.learn(cache[:4]) if codec.capabilities.learns else None
    pending = codec.start_encode_blocks(cache, ids, book)
    frame = pending.result()
    assert torch.equal(frame.cpu(), codec.encode_blocks(cache, ids, book).cpu())
    out = torch.zeros_like(cache)
    dst = torch.tensor([1, 9, 4, 10, 3], device=device)
    codec.start_decode_blocks(frame, out, dst, book).result()
    expected = torch.zeros_like(cache)
    codec.decode_blocks(frame, expected, dst, book)
    assert torch.equal(_bits(out), _bits(expected))
    assert torch.equal(_bits(out[dst]), _bits(cache[ids]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", LAUNCHING)
def test_launched_decode_refuses_what_the_waiting_one_refuses_and_writes_nothing(name):
    codec = codecs.get(name)
    cache = _cache("cuda")
    ids = torch.arange(4, device="cuda")
    frame = codec.encode_blocks(cache, ids, codec.learn(cache[:4]) if codec.capabilities.learns else None)
    out = torch.zeros_like(cache)
    broken = frame.clone()
    broken[20] ^= 0xFF  # the header
    with pytest.raises(codecs.CorruptFrame):
        codec.start_decode_blocks(broken, out, ids).result()
    if name != "raw":  # the engine checks ids at submit; these kernels check them again
        with pytest.raises(codecs.BlockOutOfRange):
            codec.start_decode_blocks(frame, out, torch.tensor([0, 1, 2, 99], device="cuda")).result()
        with pytest.raises(codecs.OutputMismatch):
            codec.start_decode_blocks(frame, out, torch.tensor([0, 1, 2, 1], device="cuda")).result()
    assert not out.view(torch.int16).any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["splitzip", "entropy"])
def test_launched_encode_checks_block_ids_on_the_device(name):
    codec = codecs.get(name)
    cache = _cache("cuda")
    pending = codec.start_encode_blocks(cache, torch.tensor([0, 12], device="cuda"), codec.learn(cache[:4]))
    with pytest.raises(codecs.BlockOutOfRange):
        pending.result()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["splitzip", "entropy"])
def test_a_launch_does_not_wait_for_the_gpu(name):
    """While a long kernel holds the stream, the launch returns and the result is not ready."""
    codec = codecs.get(name)
    cache = _cache("cuda", blocks=256)
    ids = torch.arange(256, device="cuda")
    book = codec.learn(cache[:4])
    codec.encode_blocks(cache, ids, book)  # the codebook's device tables, built once
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles ahead of the encode on this stream
    pending = codec.start_encode_blocks(cache, ids, book)
    assert not pending.ready()
    assert torch.equal(pending.result(), codec.encode_blocks(cache, ids, book))
