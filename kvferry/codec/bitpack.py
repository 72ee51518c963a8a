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
    v = torch.zeros(groups * _GROUP, dtype=torch.int32, device=values.device)
    v[:n] = values.to(torch.int32) & ((1 << k) - 1)
    v = [column.contiguous() for column in v.view(groups, _GROUP).t()]  # field i of every group
    out = torch.empty(k, groups, dtype=torch.uint8, device=values.device)
    for j in range(k):  # byte j of a group: the fields overlapping bits [8j, 8j + 8), shifted into place
        byte = None
        for i, shift in _overlaps(j, k):
            term = v[i] << shift if shift >= 0 else v[i] >> -shift
            byte = term if byte is None else byte | term
        out[j] = byte.to(torch.uint8)  # the cast keeps the low byte
    return out.t().contiguous().view(-1)[: packed_size(n, k)]


def _overlaps(byte: int, k: int) -> list[tuple[int, int]]:
    """(field, left shift) of each field in a group of 8 that has bits in byte ``byte``."""
    return [(i, i * k - 8 * byte) for i in range(_GROUP) if i * k < 8 * byte + 8 and i * k + k > 8 * byte]


def unpack(stream: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``pack``: ``n`` k-bit fields from a uint8 stream, as int32."""
    if k == 8:
        return stream[:n].to(torch.int32)
    if k == 4:
        s = stream.to(torch.int32)
        out = torch.stack([s & 0xF, s >> 4], dim=1).view(-1)
        return out[:n]
    groups = (n + _GROUP - 1) // _GROUP
    b = torch.zeros(groups * k, dtype=torch.uint8, device=stream.device)
    b[: stream.numel()] = stream
    b = b.view(groups, k).t().contiguous()  # byte j of every group in one contiguous row
    rows = [row.to(torch.int32) for row in b]
    out = torch.empty(groups, _GROUP, dtype=torch.int32, device=stream.device)
    for i in range(_GROUP):  # field i: the bytes it overlaps, shifted back
        field = None
        for j in range(i * k // 8, (i * k + k - 1) // 8 + 1):
            shift = i * k - 8 * j
            term = rows[j] >> shift if shift >= 0 else rows[j] << -shift
            field = term if field is None else field | term
        torch.bitwise_and(field, (1 << k) - 1, out=out[:, i])
    return out.view(-1)[:n]
