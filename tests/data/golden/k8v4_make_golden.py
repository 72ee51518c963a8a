"""Regenerate the quant codecs' golden frames. Run only when the quant format changes on purpose:
    python tests/data/golden/k8v4_make_golden.py
The input is a frozen file too: k8v4_input.bfloat16.bin holds [kv=2, heads=3, tokens=16, 64]
bf16 (layer 3's K and V of the sample, with a constant, a -0, a tiny-range and a full-range
vector); float16 frames code the same values converted. Frames: k8v4_frame.<codec>.<dtype>.bin."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from kvferry.codec.quant import K4V2, K8V4, QuantLayout  # noqa: E402

SAMPLE = HERE.parent / "kv_smollm2_gpl3.npz"


def frozen_input() -> torch.Tensor:
    z = np.load(SAMPLE)
    kv = [torch.from_numpy(z[f"c1_l3_{kind}"].view(np.int16)).view(torch.bfloat16)[:, :16] for kind in "kv"]
    x = torch.stack(kv).clone()
    x[0, 0, 0] = 1.5
    x[1, 1, 2] = -0.0
    x[1, 2, 3] = torch.linspace(-3e-6, 2e-6, 64)
    x[0, 2, 5] = torch.linspace(-65280, 65280, 64)
    return x


if __name__ == "__main__":
    x = frozen_input()
    (HERE / "k8v4_input.bfloat16.bin").write_bytes(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    for c in (K8V4, K4V2):
        for dtype in (torch.bfloat16, torch.float16):
            frame = c.encode(x.to(dtype), QuantLayout(0, 3))
            name = str(dtype).removeprefix("torch.")
            (HERE / f"k8v4_frame.{c.name}.{name}.bin").write_bytes(frame.numpy().tobytes())
            print(c.name, name, frame.numel(), "bytes")
