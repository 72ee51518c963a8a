"""Regenerate the entropy codec's golden frames. Run only when its format changes on purpose:
    python tests/data/golden/entropy_make_golden.py
Inputs and codebooks are frozen files too, so the goldens never depend on the calibration or a
random generator: entropy_<dtype>.input.bin (element bytes), .codebook.json, .frame.bin."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from kvferry.codec import entropy  # noqa: E402

SAMPLE = HERE.parent / "kv_smollm2_gpl3.npz"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e5m2": torch.float8_e5m2,
          "float8_e4m3fn": torch.float8_e4m3fn}
SHAPE_TOKENS = 80  # [heads=3, tokens=80, head_dim=64]: 15360 elements, 4 chunks of 4096 (the last short)
CHUNK = 4096
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -3e-39, 6e-8, 2.0 ** 100, -(2.0 ** -30)]


def kv_slice(chunk: int) -> torch.Tensor:
    z = np.load(SAMPLE)
    return torch.from_numpy(z[f"c{chunk}_l3_k"].view(np.int16)).view(torch.bfloat16)[:, :SHAPE_TOKENS].float()


def frozen_input(dtype: torch.dtype) -> torch.Tensor:
    """Layer 3's K of chunk 1 with specials (NaN, Inf, -0, subnormals, out-of-range) every 97th."""
    x = kv_slice(1).clone().reshape(-1)
    for j, i in enumerate(range(5, x.numel(), 97)):
        x[i] = SPECIALS[j % len(SPECIALS)]
    return x.view(3, SHAPE_TOKENS, 64).to(dtype)


if __name__ == "__main__":
    for name, dtype in DTYPES.items():
        x = frozen_input(dtype)
        book = entropy.calibrate(kv_slice(0).to(dtype), token_axis=1, tables=3)
        frame = entropy.encode(x, book, chunk=CHUNK)
        assert frame[6].item() == entropy.FRAME_ID, f"{name}: the golden must be an entropy frame"
        (HERE / f"entropy_{name}.input.bin").write_bytes(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        (HERE / f"entropy_{name}.codebook.json").write_text(book.to_json() + "\n")
        (HERE / f"entropy_{name}.frame.bin").write_bytes(frame.numpy().tobytes())
        print(name, frame.numel(), "bytes,", x.numel() * x.element_size() / frame.numel(), "ratio")
