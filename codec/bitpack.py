"""LSB-first bit streams of k-bit fields, vectorized in torch.

Element i occupies bits ``[i*k, (i+1)*k)`` of the stream, bit 0 being the least significant bit
of byte 0. For k=8 that is a byte stream and for k=4 two codes per byte, low nibble first.
Groups of 8 elements fill exactly k bytes, which is how the generic path works.
"""

from __future__ import annotations

import torch

_GROUP = 8


def packed_size(n: int, k: int) -> int:
    return (n * k + 7) // 8


def pack(values: torch.Tensor, k: int) -> torch.Tensor:
    """Pack the low ``k`` bits (1..16) of each integer in ``values`` (1-D) into a uint8 stream."""
    n = values.numel()
    if k == 8:
        return values.to(torch.uint8)
    if k == 4:
        v = values.to(torch.uint8)
        if n % 2:
            v = torch.cat([v, v.new_zeros(1)])
        pairs = v.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    groups = (n + _GROUP - 1) // _GROUP
    v = torch.zeros(groups * _GROUP, dtype=torch.int64, device=values.device)
    v[:n] = values.to(torch.int64) & ((1 << k) - 1)
    v = v.view(groups, _GROUP)
    # A group holds 8k <= 128 bits: a low and a high 64-bit word (int64 shifts wrap, which is
    # exactly the truncation wanted; sign bits are masked off when bytes are extracted).
    lo = torch.zeros(groups, dtype=torch.int64, device=values.device)
    hi = torch.zeros_like(lo)
    for i in range(_GROUP):
        shift = i * k
        if shift < 64:
            lo |= v[:, i] << shift
            if shift + k > 64:
                hi |= v[:, i] >> (64 - shift)
        else:
            hi |= v[:, i] << (shift - 64)
    out = torch.empty(groups, k, dtype=torch.uint8, device=values.device)
    for j in range(k):
        word, byte = (lo, j) if j < 8 else (hi, j - 8)
        out[:, j] = ((word >> (8 * byte)) & 0xFF).to(torch.uint8)
    return out.view(-1)[: packed_size(n, k)]


def unpack(stream: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``pack``: ``n`` k-bit fields from a uint8 stream, as int32."""
    if k == 8:
        return stream[:n].to(torch.int32)
    if k == 4:
        s = stream.to(torch.int32)
        out = torch.stack([s & 0xF, s >> 4], dim=1).view(-1)
        return out[:n]
    groups = (n + _GROUP - 1) // _GROUP
    b = torch.zeros(groups * k, dtype=torch.int64, device=stream.device)
    b[: stream.numel()] = stream.to(torch.int64)
    b = b.view(groups, k)
    lo = torch.zeros(groups, dtype=torch.int64, device=stream.device)
    hi = torch.zeros_like(lo)
    for j in range(k):
        if j < 8:
            lo |= b[:, j] << (8 * j)
        else:
            hi |= b[:, j] << (8 * (j - 8))
    mask = (1 << k) - 1
    out = torch.empty(groups, _GROUP, dtype=torch.int64, device=stream.device)
    for i in range(_GROUP):
        shift = i * k
        if shift + k <= 64:
            field = (lo >> shift) if shift else lo
        elif shift < 64:
            low_part = (lo >> shift) & ((1 << (64 - shift)) - 1)
            field = low_part | (hi << (64 - shift))
        else:
            field = hi >> (shift - 64)
        out[:, i] = field & mask
    return out.view(-1)[:n].to(torch.int32)
