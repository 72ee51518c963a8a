"""GPU path of the entropy codec (placeholder until the kernels land): ``available`` is False,
so CUDA tensors go through the CPU reference by way of host copies."""

from __future__ import annotations


def available() -> bool:
    return False
