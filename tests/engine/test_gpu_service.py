"""The daemon on a GPU: owned GPU regions and cuda_ipc regions mapped from this (worker) process,
moved through the GPU codec end to end. Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from kvferry.codec.splitzip import gpu as splitzip_gpu
from tests.conftest import bits_equal
from tests.engine.conftest import spawn, stop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not splitzip_gpu.available(), reason="needs a CUDA GPU and CuPy")]


def _has_ucxx() -> bool:
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return False
    return True


# ucxx moves the CUDA buffers themselves (cuda_ipc on one host); TCP stages them through the host.
BACKENDS = ["tcp", pytest.param("ucxx", marks=pytest.mark.skipif(not _has_ucxx(), reason="needs ucxx"))]


def _gpu_pair(backend: str = "tcp"):
    env = {"KVFERRY_CHUNK_BYTES": str(1 << 20), "UCX_TLS": "tcp,cuda_copy,cuda_ipc"}
    return spawn(backend, env, device="cuda"), spawn(backend, env, device="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_owned_gpu_regions_splitzip(kv, backend):
    a, b = _gpu_pair(backend)
    try:
        info, _ = a.client.region_from_tensor("kv", kv)
        assert info["device"].startswith("cuda")
        b.client.create_region("kv", 60, list(kv.shape[1:]), "bfloat16")
        ids = list(range(60))
        result = a.client.wait(a.client.submit("kv", ids, b.data, "kv", ids[::-1], codec="splitzip"), timeout=120)
        assert result["state"] == "done" and result["ratio"] > 1.3, result
        got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("kv", i)), dtype=torch.bfloat16)
                           .view(kv.shape[1:]) for i in ids[::-1]])
        assert bits_equal(got, kv)
    finally:
        stop(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_ipc_regions_from_the_worker_process(kv, backend):
    a, b = _gpu_pair(backend)
    try:
        source = kv.cuda()
        target = torch.zeros_like(source)
        a.client.region_from_tensor("kv", source, kind="cuda_ipc")
        b.client.region_from_tensor("kv", target, kind="cuda_ipc")
        ids = list(range(60))
        result = a.client.wait(a.client.submit("kv", ids, b.data, "kv", ids, codec="splitzip"), timeout=120)
        assert result["state"] == "done", result
        torch.cuda.synchronize()
        assert bits_equal(target.cpu(), kv)  # written straight into this process's tensor
    finally:
        stop(a, b)
