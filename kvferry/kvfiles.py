"""Loading KV tensors from files for calibration and demos (.npz, .npy, .pt)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16}


def load_tensors(path: str | Path, dtype: str, select: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each array in ``path`` whose name matches ``select``.

    Integer arrays of the dtype's width are taken as bit patterns and viewed as ``dtype`` (the
    way KV dumps store bf16, which numpy lacks); float tensors must already be ``dtype``.

    Raises:
        ValueError: unknown file type, or an array that is neither ``dtype`` nor its bit width.
    """
    target = getattr(torch, dtype)
    path = Path(path)
    pattern = re.compile(select) if select else None
    for name, tensor in _arrays(path):
        if pattern and not pattern.search(name):
            continue
        yield name, _as_dtype(tensor, target, f"{path}:{name}")


def _arrays(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    suffix = path.suffix.lower()
    if suffix in (".npz", ".npy"):
        import numpy as np

        data = np.load(path, allow_pickle=False)
        if suffix == ".npy":
            yield path.stem, torch.from_numpy(np.ascontiguousarray(data))
            return
        for key in data.files:
            if data[key].dtype.kind in "uif":
                yield key, torch.from_numpy(np.ascontiguousarray(data[key]))
    elif suffix in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        items = obj.items() if isinstance(obj, dict) else [(path.stem, obj)]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                yield str(key), value
    else:
        raise ValueError(f"{path}: unsupported file type (use .npz, .npy or .pt)")


def _as_dtype(tensor: torch.Tensor, target: torch.dtype, where: str) -> torch.Tensor:
    if tensor.dtype == target:
        return tensor
    width = torch.empty((), dtype=target).element_size()
    if not tensor.dtype.is_floating_point and tensor.element_size() == width:
        return tensor.view(_INT_OF_WIDTH[width]).view(target)
    raise ValueError(f"{where}: {tensor.dtype} is neither {target} nor its {width}-byte bit pattern")
