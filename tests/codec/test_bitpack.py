"""The k-bit stream packer against a bit-by-bit reading of FORMAT.md's definition."""

from __future__ import annotations

import pytest
import torch

from kvferry.codec import bitpack


def reference_pack(values: list[int], k: int) -> bytes:
    out = bytearray((len(values) * k + 7) // 8)
    for i, v in enumerate(values):
        for b in range(k):
            if (v >> b) & 1:
                j = i * k + b
                out[j // 8] |= 1 << (j % 8)
    return bytes(out)


@pytest.mark.parametrize("k", range(1, 17))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 100])
def test_pack_matches_definition(k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    values = torch.randint(0, 1 << k, (n,), generator=gen, dtype=torch.int32)
    packed = bitpack.pack(values, k)
    assert bytes(packed.tolist()) == reference_pack(values.tolist(), k)
    assert torch.equal(bitpack.unpack(packed, n, k), values)


def test_four_bit_codes_low_nibble_first():
    assert bitpack.pack(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
