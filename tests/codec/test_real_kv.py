"""Real SmolLM2 KV: bit-exact round trips and the compression ratio the paper predicts."""

from __future__ import annotations

import pytest
import torch

from kvferry import codec
from tests.conftest import bits_equal


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_ratio_with_codebook_from_other_chunk(real_kv):
    """Calibrate on chunk 0, apply to chunk 1 (and the reverse): ratio >= 1.32, header included."""
    for calib, data in (("c0", "c1"), ("c1", "c0")):
        book = codec.calibrate(real_kv[calib])
        x = _flat(real_kv[data])
        frame = codec.encode(x, book)
        ratio = x.numel() * 2 / frame.numel()
        assert ratio >= 1.32, f"{calib}->{data}: ratio {ratio:.4f}"
        assert bits_equal(codec.decode(frame), x)


def test_every_layer_roundtrips_with_per_kind_books(real_kv):
    books = {kind: codec.calibrate(real_kv[f"c0_{kind}"]) for kind in "kv"}
    for kind in "kv":
        for layer in real_kv[f"c1_{kind}"]:
            frame = codec.encode(layer, books[kind], checksum=True)
            assert bits_equal(codec.decode(frame), layer)


@pytest.mark.parametrize("dtype,min_ratio", [(torch.float16, 1.0), (torch.float8_e5m2, 1.10),
                                             (torch.float8_e4m3fn, 0.99)], ids=str)
def test_other_dtypes_of_real_kv(real_kv, dtype, min_ratio):
    book = codec.calibrate([t.to(dtype) for t in real_kv["c0"]])
    x = _flat(real_kv["c1"]).to(dtype)
    frame = codec.encode(x, book)
    raw = x.numel() * x.element_size()
    assert frame.numel() <= raw + codec.HEADER_SIZE
    assert raw / frame.numel() >= min_ratio
    assert bits_equal(codec.decode(frame), x)
