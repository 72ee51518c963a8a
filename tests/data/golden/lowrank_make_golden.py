"""Regenerate the lowrank golden frames (run from the repository root; only when the format
version changes): ``python tests/data/golden/lowrank_make_golden.py``.

Each case: a codebook calibrated on chunk 0 of the real SmolLM2 KV (layers 0-1), an input of
two blocks [layer, kv, head, 8 tokens, channel] from chunk 1, the frame, and the reconstruction.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kvferry.codec import lowrank
from kvferry.codec.layout import BlockLayout

HERE = Path(__file__).parent
SAMPLE = HERE.parent / "kv_smollm2_gpl3.npz"
AXES = ("layer", "kv", "head", "token", "channel")
CASES = {"lowrank_bfloat16": (torch.bfloat16, None, 0.95), "lowrank_float16_k8v4": (torch.float16, "k8v4", 0.9)}


def chunk(z, c: int, layers: int = 2) -> torch.Tensor:
    return torch.stack([torch.stack([torch.from_numpy(z[f"c{c}_l{l}_{kv}"].view(np.int16)).view(torch.bfloat16)
                                     for kv in "kv"]) for l in range(layers)])


def main() -> None:
    z = np.load(SAMPLE)
    for name, (dtype, quantize, energy) in CASES.items():
        book = lowrank.calibrate(chunk(z, 0).to(dtype), axes=AXES, energy=energy, quantize=quantize)
        x = chunk(z, 1)[:, :, :, 100:116].to(dtype).reshape(2, 2, 3, 2, 8, 64).permute(3, 0, 1, 2, 4, 5).contiguous()
        bound = lowrank.bind(book, BlockLayout(tuple(x.shape[1:]), AXES))
        frame = lowrank.encode(x, bound)
        y = lowrank.decode(frame, bound)
        (HERE / f"{name}.codebook.json").write_text(book.to_json())
        (HERE / f"{name}.meta.json").write_text(json.dumps({"dtype": str(dtype).removeprefix("torch."),
                                                             "shape": list(x.shape), "axes": list(AXES)}))
        (HERE / f"{name}.input.bin").write_bytes(x.view(torch.int16).numpy().tobytes())
        (HERE / f"{name}.frame.bin").write_bytes(frame.numpy().tobytes())
        (HERE / f"{name}.output.bin").write_bytes(y.contiguous().view(torch.int16).numpy().tobytes())
        print(name, frame.numel(), "bytes", book.ranks.tolist())


if __name__ == "__main__":
    main()
