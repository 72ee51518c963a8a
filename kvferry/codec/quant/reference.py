"""The quantizer's definition in torch ops: what every byte and every reconstructed value is.

Per vector ``x`` (one K or V vector along the channel axis, in fp32) with ``L = 2**bits - 1``:

    lo, hi = min(x), max(x)                  (lo = -0 is taken as +0)
    z = the largest fp16 value <= lo          (round to nearest, one fp16 step down if above lo)
    s = the smallest fp16 value >= max((hi - z) / L, 2**-24)    (fp32 ops, IEEE division)
    r = 1 / s                                 (fp32, IEEE division: once per vector)
    q = clamp(rint((x - z) * r), 0, L)        (fp32, ties to even)
    x' = round_to_dtype(clamp(q * s + z, -65504, 65504))        (fp32; q*s is exact, FMA or not)

The GPU kernels (``gpu.py``) do the same operations in the same order. Every step is a correctly
rounded IEEE operation, so both write the same bytes and reconstruct the same values. A
reciprocal per vector, not a division per element, keeps the kernels memory-bound.
"""

from __future__ import annotations

import torch

from .. import bitpack
from ..errors import UnsupportedTensor
from .format import FP16_MAX

MIN_SCALE = 2.0 ** -24  # the smallest fp16 subnormal: s > 0 even when hi == lo


def check_finite(x: torch.Tensor) -> None:
    """Raises: UnsupportedTensor: an element that is NaN, infinite or beyond the fp16 range."""
    bad = ~(x.float().abs() <= FP16_MAX)
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        raise UnsupportedTensor(f"element {i} is {x.reshape(-1)[i].item()}: quant codecs take finite values "
                                f"within the fp16 range (|x| <= {FP16_MAX:g}), scales and zeros are fp16")


def canonical(x: torch.Tensor, kv_axis: int, channel_axis: int) -> torch.Tensor:
    """``x`` as [2, vectors, channels]: kind first, channel last, the other axes in order."""
    moved = x.movedim((kv_axis, channel_axis), (0, -1))
    return moved.reshape(2, -1, x.shape[channel_axis])


def _fp16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int16).view(torch.float16)  # int32 -> int16 keeps the low 16 bits


def round_down_fp16(v: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value <= each fp32 value of ``v`` (within the fp16 range)."""
    b = _fp16_bits(v)
    step = torch.where(b == 0, 0x8001, torch.where(b >= 0x8000, b + 1, b - 1))
    return _from_bits(torch.where(_from_bits(b).float() > v, step, b))


def round_up_fp16(v: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= each positive fp32 value of ``v`` (within the fp16 range)."""
    b = _fp16_bits(v)
    return _from_bits(torch.where(_from_bits(b).float() < v, b + 1, b))


def quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8 [n, C]), scales and zeros (fp16 [n]) of the fp32 vectors ``v`` [n, C]."""
    levels = (1 << bits) - 1
    lo, hi = v.amin(1), v.amax(1)
    lo = torch.where(lo == 0, 0.0, lo)  # min(-0, +0) is either: pin it so z's bits are defined
    z = round_down_fp16(lo)
    d = torch.clamp_min((hi - z.float()) / torch.full_like(hi, levels), MIN_SCALE)
    s = round_up_fp16(d)
    r = torch.ones_like(d) / s.float()
    q = torch.round((v - z.float()[:, None]) * r[:, None]).clamp_(0, levels)
    return q.to(torch.uint8), s, z


def dequantize(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reconstruction of codes ``q`` [n, C] with scales and zeros [n], in ``dtype``."""
    y = q.float() * s.float()[:, None] + z.float()[:, None]
    return y.clamp_(-FP16_MAX, FP16_MAX).to(dtype)


def encode_streams(x: torch.Tensor, kv_axis: int, channel_axis: int,
                   bits: tuple[int, int]) -> tuple[bytes, bytes, bytes]:
    """The K code, V code and parameter streams of a CPU tensor.

    Raises:
        UnsupportedTensor: a non-finite or out-of-range element.
    """
    check_finite(x)
    v = canonical(x.float(), kv_axis, channel_axis)
    codes, params = [], []
    for kind in (0, 1):
        q, s, z = quantize(v[kind], bits[kind])
        codes.append(bitpack.pack(q.reshape(-1), bits[kind]).numpy().tobytes())
        params.append(torch.stack([s, z], 1).view(torch.uint8).numpy().tobytes())
    return codes[0], codes[1], b"".join(params)


def decode_streams(k_codes: torch.Tensor, v_codes: torch.Tensor, params: torch.Tensor, shape: tuple[int, ...],
                   kv_axis: int, channel_axis: int, bits: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` that checked CPU streams (uint8) reconstruct."""
    c = shape[channel_axis]
    n = params.numel() // 8
    pairs = params.view(torch.float16).view(2, n, 2)
    kinds = []
    for kind, stream in enumerate((k_codes, v_codes)):
        q = bitpack.unpack(stream, n * c, bits[kind]).view(n, c)
        kinds.append(dequantize(q, pairs[kind, :, 0], pairs[kind, :, 1], dtype))
    moved = [shape[i] for i in range(len(shape)) if i not in (kv_axis, channel_axis)]
    return torch.stack(kinds).view(2, *moved, c).movedim((0, -1), (kv_axis, channel_axis)).contiguous()
