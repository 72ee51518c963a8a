"""Regenerate the golden frames. Run only when the format version changes on purpose:
    python tests/data/golden/make_golden.py
The inputs are frozen files too, so the goldens never depend on a random generator's version."""

from __future__ import annotations

from pathlib import Path

import torch

from kvferry import codec

HERE = Path(__file__).parent
CASES = {
    # name: (dtype, element count, checksum)
    "bfloat16": (torch.bfloat16, 2500, False),
    "float16": (torch.float16, 1500, True),
    "float8_e5m2": (torch.float8_e5m2, 2100, False),
    "float8_e4m3fn": (torch.float8_e4m3fn, 900, False),  # too spread for top-8: stored
    "float8_e4m3fn_narrow": (torch.float8_e4m3fn, 1800, False),  # top-8 wins: coded
}


def frozen_input(name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Smooth values (a compressible KV-like spread) with every 97th element an outlier."""
    i = torch.arange(n, dtype=torch.float64)
    values = torch.sin(i * 0.37) * torch.cos(i * 0.011) * 4.0
    if name.endswith("_narrow"):
        values = (values.abs() + 0.5) * 20.0
    values[::97] = 2.0 ** (i[::97] % 60 - 30)
    return values.to(dtype)


if __name__ == "__main__":
    for name, (dtype, n, checksum) in CASES.items():
        x = frozen_input(name, dtype, n)
        (HERE / f"{name}.input.bin").write_bytes(x.view(torch.uint8).numpy().tobytes())
        (HERE / f"{name}.frame.bin").write_bytes(codec.encode(x, checksum=checksum).numpy().tobytes())
        print(name, codec.read_header(codec.encode(x)))
