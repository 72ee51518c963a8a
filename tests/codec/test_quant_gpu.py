"""k8v4 / k4v2 Triton kernels against the CPU reference, byte for byte and value for value.

``test_gpu_*`` run the kernels on CUDA (skipped without CUDA or triton); ``test_interpreter_*``
runs the same checks under ``TRITON_INTERPRET=1`` on CPU tensors in a subprocess (skipped when
triton does not import)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry import codec
from kvferry.codec import quant
from kvferry.codec.quant import K4V2, K8V4, QuantLayout, read_header
from kvferry.codec.quant.codec import _finish
from kvferry.codec.quant.format import QuantHeader
from tests.codec.test_quant import kv_like
from tests.conftest import bits_equal

ROOT = Path(__file__).parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = HAS_TRITON and torch.cuda.is_available()

# (shape, kv axis, channel axis): in place, channel not last (one movedim copy), C = 128 and 96.
SHAPES = [((3, 2, 9, 4, 64), 1, 4), ((64, 5, 2), 2, 0), ((2, 3, 8, 128), 0, 3), ((2, 5, 96), 0, 2)]


def with_specials(x: torch.Tensor, channel_axis: int) -> torch.Tensor:
    """Constant, signed-zero and full-range vectors among the random ones."""
    y = x.clone().movedim(channel_axis, -1).contiguous()
    v = y.view(-1, y.shape[-1])
    v[0], v[1] = 1.5, -0.0
    v[-1] = torch.linspace(-65280, 65280, v.shape[1])
    return y.movedim(-1, channel_axis).contiguous()


def kernel_frame(src: torch.Tensor, header: QuantHeader, ids: torch.Tensor | None = None) -> torch.Tensor:
    from kvferry.codec.quant import gpu
    frame = torch.full((header.total,), 0xAB, dtype=torch.uint8, device=src.device)
    gpu.encode_into(src, frame, header, ids)
    return _finish(frame, header, checksum=False)


def kernel_checks(device: str) -> None:
    """Kernels on ``device`` (``cpu`` only under the interpreter) against the reference."""
    from kvferry.codec.quant import gpu
    for dtype in (torch.bfloat16, torch.float16):
        for c in (K8V4, K4V2):
            for seed, (shape, kv, ch) in enumerate(SHAPES):
                x = with_specials(kv_like(shape, dtype, seed), ch)
                ref = quant.encode(x, QuantLayout(kv, ch), c.frame_id, checksum=False)
                header = read_header(ref)
                got = kernel_frame(x.to(device), header)
                assert torch.equal(got.cpu(), ref), (c.name, dtype, shape)
                y = torch.empty(shape, dtype=dtype, device=device)
                if gpu.supports_in_place(y, kv, ch, False):
                    gpu.decode_into(ref.to(device), y, header)
                    assert bits_equal(y.cpu(), quant.decode(ref)), (c.name, dtype, shape)
            # Blocks: gathered and scattered by the kernels, or gathered by one copy (kv axis first);
            # (1, 4): several slabs per block (layers before kv), tiles spanning blocks.
            for block_axes, block_shape in (((0, 3), (2, 3, 5, 64)), ((0, 1), (2, 64, 3)),
                                            ((1, 4), (3, 2, 5, 3, 64)), ((1, 3), (2, 2, 3, 128))):
                cache = with_specials(kv_like((6, *block_shape), dtype, 10), block_axes[1] + 1)
                ids = torch.tensor([3, 0, 5])
                bound = QuantLayout(*block_axes)
                ref = quant.encode_blocks(cache, ids, bound, c.frame_id, checksum=False)
                header = read_header(ref)
                assert torch.equal(kernel_frame(cache.to(device), header, ids.to(device)).cpu(), ref)
                expected = torch.zeros_like(cache)
                quant.decode_blocks(ref, expected, torch.tensor([4, 1, 2]))
                target = torch.zeros_like(cache, device=device)
                if gpu.supports_in_place(target, header.kv_axis, header.channel_axis, True):
                    gpu.decode_into(ref.to(device), target, header, torch.tensor([4, 1, 2], device=device))
                    assert bits_equal(target.cpu(), expected)
                    dev = ref.to(device)
                    flag = gpu.check_frame(dev, header, torch.tensor([4, 1, 2], device=device), 6)
                    assert int(flag.item()) == 0
                    for bad_ids, bit in (([4, 6, 2], gpu.BAD_ID), ([4, -1, 2], gpu.BAD_ID),
                                         ([4, 1, 4], gpu.REPEATED_ID)):
                        flag = gpu.check_frame(dev, header, torch.tensor(bad_ids, device=device), 6)
                        assert int(flag.item()) == bit, bad_ids
                    bad = dev.clone()
                    bad[header.offsets[2] + 1] = 0x7C  # the first K scale: infinite
                    flag = gpu.check_frame(bad, header, torch.tensor([0, 1, 2], device=device), 6)
                    assert int(flag.item()) == gpu.BAD_PARAMS
                    untouched = torch.zeros_like(target)
                    gpu.decode_into(bad, untouched, header, torch.tensor([0, 1, 2], device=device), flag=flag)
                    assert not untouched.view(torch.int16).any()
                    with pytest.raises(codec.BlockOutOfRange):
                        kernel_frame(cache.to(device), header, torch.tensor([3, 6, 5], device=device))
    x = kv_like((2, 4, 64), torch.bfloat16, 20)
    x[1, 3, 7] = float("nan")
    header = QuantHeader(3, torch.bfloat16, (2, 4, 64), 0, 2)
    with pytest.raises(codec.UnsupportedTensor, match="fp16 range"):
        kernel_frame(x.to(device), header)
    # Padding: 3 vectors of 6 bytes leave K's stream padded.
    frame = quant.encode(kv_like((2, 3, 6), torch.bfloat16, seed=9), QuantLayout(0, 2), 3, checksum=False)
    header = read_header(frame)
    assert int(gpu.check_frame(frame.to(device), header).item()) == 0
    bad = frame.clone()
    bad[header.offsets[0] + header.lengths[0]] = 1
    assert int(gpu.check_frame(bad.to(device), header).item()) == gpu.BAD_PADDING


@pytest.mark.skipif(not HAS_TRITON, reason="triton does not import")
def test_interpreter_kernels_match_reference():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    code = "from tests.codec.test_quant_gpu import kernel_checks; kernel_checks('cpu')"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")
def test_gpu_kernels_match_reference():
    kernel_checks("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_codec_bytes_equal_cpu_bytes(real_kv, dtype):
    x = torch.stack([torch.stack(real_kv["c1_k"]), torch.stack(real_kv["c1_v"])], 1).to(dtype)
    layout = QuantLayout(1, 4)
    for c in (K8V4, K4V2):
        cpu = c.encode(x, layout)
        dev = c.encode(x.cuda(), layout)
        assert dev.is_cuda and torch.equal(dev.cpu(), cpu), c.name
        y = c.decode(cpu.cuda())
        assert y.is_cuda and bits_equal(y.cpu(), c.decode(cpu))
        cache = x.cuda()  # blocks = layers: [kv, head, token, channel]
        bound = c.bind(None, codec.BlockLayout(tuple(x.shape[1:]), ("kv", "head", "token", "channel")))
        ids = torch.tensor([7, 2, 29], device="cuda")
        frame = c.encode_blocks(cache, ids, bound)
        assert torch.equal(frame.cpu(), c.encode_blocks(x, ids.cpu(), bound))
        target = torch.zeros_like(cache)
        c.decode_blocks(frame, target, torch.tensor([0, 1, 2], device="cuda"), bound)
        assert bits_equal(target[:3].cpu(), c.decode(frame.cpu())) and not target[3:].view(torch.int16).any()
        bad = frame.clone()
        bad[-3] = 0x7C  # the last V scale: infinite (the registry's frames carry no stream CRC)
        with pytest.raises(codec.CorruptFrame):
            c.decode_blocks(bad, target, torch.tensor([5, 6, 7], device="cuda"), bound)
        assert not target[3:].view(torch.int16).any()
        nan = x.cuda().clone()
        nan[3, 1, 2, 4, 5] = float("inf")
        with pytest.raises(codec.UnsupportedTensor):
            c.encode(nan, layout)
