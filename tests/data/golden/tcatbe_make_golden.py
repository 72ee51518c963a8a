"""Regenerate the tca-tbe codec's golden frames. Run only when its format changes on purpose:
    python tests/data/golden/tcatbe_make_golden.py
Inputs are frozen files too (tcatbe_<name>.input.bin, element bytes), so the goldens never depend
on a random generator: tcatbe_<name>.frame.bin is the reference encoder's frame of the input."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

from kvferry.codec import tcatbe  # noqa: E402

SAMPLE = HERE.parent / "kv_smollm2_gpl3.npz"
SPECIALS = [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8005, 0x7F7F, 0x0080, 0x3F80]
# name: (shape, checksum)
GOLDENS = {"bfloat16": ((3, 80, 64), True), "bfloat16_tail": ((5, 13, 7), False)}


def frozen_input(name: str) -> torch.Tensor:
    """``bfloat16``: layer 3's K of chunk 1 ([3, 80, 64], 240 tiles), NaN payloads, infinities,
    -0, subnormals and out-of-window exponents every 97th element. ``bfloat16_tail``: 455 small
    values (window at exponent 0: zeros and subnormals coded), the last tile 7/64 full."""
    shape, _ = GOLDENS[name]
    if name == "bfloat16":
        z = np.load(SAMPLE)
        bits = z["c1_l3_k"].view(np.uint16)[:, :80].copy().reshape(-1)
        for j, i in enumerate(range(5, bits.size, 97)):
            bits[i] = SPECIALS[j % len(SPECIALS)]
    else:
        i = np.arange(int(np.prod(shape)), dtype=np.uint32)
        h = (i * 2654435761) >> 9
        bits = ((h & 0x807F) | (i % 7) << 7).astype(np.uint16)  # exponents 0..6, both signs
        bits[::50] = 0x7FC0
    return torch.from_numpy(bits.view(np.int16).reshape(shape)).view(torch.bfloat16)


if __name__ == "__main__":
    for name, (shape, checksum) in GOLDENS.items():
        x = frozen_input(name)
        frame = tcatbe.encode(x, checksum=checksum)
        assert frame[6].item() == tcatbe.FRAME_ID, f"{name}: the golden must be a tca-tbe frame"
        (HERE / f"tcatbe_{name}.input.bin").write_bytes(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        (HERE / f"tcatbe_{name}.frame.bin").write_bytes(frame.numpy().tobytes())
        print(name, frame.numel(), "bytes, ratio", x.numel() * 2 / frame.numel(),
              "window_low", tcatbe.read_header(frame).window_low)
