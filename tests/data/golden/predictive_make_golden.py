"""Regenerate the predictive golden files (run from the repository root; only when the format
version changes):

    .venv/bin/python tests/data/golden/predictive_make_golden.py

Inputs come from ``tests/data/predictive_pair.npz`` (SmolLM2-135M BF16 target and its FP8-weight
predictor, 3 layers, 64 tokens of GPL-3): the codebook is calibrated on tokens 0..31 and the
golden region is tokens 32..47 of layer 0, one block of 16 tokens (the codebook: layer 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from kvferry.codec.layout import BlockLayout  # noqa: E402
from kvferry.codec.predictive import bind, calibrate_predictive, encode  # noqa: E402

HERE = Path(__file__).resolve().parent
PAIR = HERE.parent / "predictive_pair.npz"
AXES = ("layer", "kv", "head", "token", "channel")


def load_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """(target, predictor) bf16, [3 layers, 2, 3 heads, 64 tokens, 64 channels]."""
    z = np.load(PAIR)
    return tuple(torch.from_numpy(z[k].view(np.int16)).view(torch.bfloat16) for k in ("target", "predictor"))


def main() -> None:
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        target, predictor = load_pair()
        t = target.to(dtype)
        book = calibrate_predictive(t[:1, ..., :32, :], predictor[:1, ..., :32, :], AXES, predictor_name="golden")
        x = t[:1, :, :, 32:48, :].unsqueeze(0)
        ref = predictor[:1, :, :, 32:48, :].unsqueeze(0)
        frame = encode(x, bind(book, BlockLayout(tuple(x.shape[1:]), AXES), ref))
        name = str(dtype).removeprefix("torch.")
        (HERE / f"predictive_{name}.codebook.json").write_text(book.to_json())
        bits = torch.uint8 if x.element_size() == 1 else torch.int16
        (HERE / f"predictive_{name}.input.bin").write_bytes(x.contiguous().view(bits).numpy().tobytes())
        (HERE / f"predictive_{name}.reference.bin").write_bytes(ref.contiguous().view(torch.int16).numpy().tobytes())
        (HERE / f"predictive_{name}.frame.bin").write_bytes(frame.numpy().tobytes())
        print(name, list(x.shape), f"{frame.numel()} bytes")


if __name__ == "__main__":
    main()
