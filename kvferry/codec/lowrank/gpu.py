"""GPU path of the lowrank codec: Triton kernels that perform ``reference.py``'s arithmetic.

Each program takes ``BLOCK_M`` vectors of one group (layer, K/V, head). Encode accumulates the
coefficients over an explicit loop on the channel index j = 0 .. d-1, decode over the rank index
k = 0 .. r-1; kernels are launched with ``enable_fp_fusion=False`` so every multiply and add
rounds on its own, as numpy's do. Divisions are ``div_rn`` (correctly rounded, like numpy's),
rounding to an integer is the ``+1.5*2**23`` trick, bf16 rounding is done on the bits. The
launchers work on any device Triton runs on, so ``TRITON_INTERPRET=1`` checks the kernels on a
CPU (``tests/codec/test_lowrank_interpret.py``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import InvalidArgument
from .codebook import LowRankCodebook
from .reference import code_bytes, stream_lengths

BLOCK_M = 32


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def available() -> bool:
    """True when Triton and a CUDA GPU are both usable."""
    return _triton() is not None and torch.cuda.is_available()


@functools.cache
def _kernels():
    from . import kernels

    return _triton()[0], kernels.encode_kernel, kernels.decode_kernel


def _constants(book: LowRankCodebook, device: torch.device) -> dict[str, torch.Tensor]:
    key = ("gpu", str(device))
    if key not in book._cache:
        bits = book.bits()
        per_vector = np.array([code_bytes(int(r), int(b)) for r, b in zip(book.ranks, bits)], dtype=np.int64)
        book._cache[key] = {
            "rot": torch.from_numpy(book.rotations).to(device).contiguous(),
            "rot_t": torch.from_numpy(np.ascontiguousarray(book.rotations.transpose(0, 2, 1))).to(device),
            "mean": torch.from_numpy(book.means).to(device).contiguous(),
            "rank": torch.from_numpy(book.ranks.astype(np.int32)).to(device),
            "bits": torch.from_numpy(bits.astype(np.int32)).to(device),
            # stream offsets per vector: group g starts at M * prefix[g] (bf16 words / code bytes)
            "coef_pre": torch.from_numpy(np.concatenate([[0], np.cumsum(book.ranks)[:-1]]).astype(np.int64)).to(device),
            "code_pre": torch.from_numpy(np.concatenate([[0], np.cumsum(per_vector)[:-1]]).astype(np.int64)).to(device),
        }
    return book._cache[key]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def encode_streams(xg: torch.Tensor, book: LowRankCodebook) -> tuple[torch.Tensor, torch.Tensor]:
    """(params, coefficients) streams, uint8 on ``xg.device``, of ``xg`` ``(groups, vectors, d)``
    bf16/fp16: the reference's bytes."""
    triton, encode_kernel, _ = _kernels()
    if xg.dtype not in (torch.bfloat16, torch.float16) or xg.dim() != 3 or xg.shape[0] != book.groups \
            or xg.shape[2] != book.channels:
        raise InvalidArgument(f"encode_streams takes (groups, vectors, d) bf16/fp16, got {xg.dtype}{list(xg.shape)}")
    xg = xg.contiguous()
    g, m, d = xg.shape
    c = _constants(book, xg.device)
    n_params, n_coefs = stream_lengths(book, m)
    quant = book.quantize is not None
    params = torch.zeros(n_params // 2, dtype=torch.float16, device=xg.device)
    coefs = torch.empty(n_coefs if quant else n_coefs // 2, dtype=torch.uint8 if quant else torch.uint16,
                        device=xg.device)
    if quant:
        coefs.zero_()  # the unused high nibbles of odd-rank 4-bit codes
    if m and int(book.ranks.max(initial=0)):
        half = max(1, _pow2(int(book.ranks.max())) // 2)
        grid = (g, triton.cdiv(m, BLOCK_M))
        encode_kernel[grid](xg, c["rot"], c["mean"], c["rank"], c["bits"], c["coef_pre"], c["code_pre"],
                            coefs, params, coefs, m, D=d, HALF=half, BLOCK=BLOCK_M, QUANT=quant,
                            enable_fp_fusion=False)
    return params.view(torch.uint8), coefs.view(torch.uint8)


def decode_streams(params: torch.Tensor, coefs: torch.Tensor, book: LowRankCodebook, vectors: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Reconstruction ``(groups, vectors, d)`` of ``dtype`` from a checked frame's streams (uint8
    tensors on one device): the reference's values."""
    triton, _, decode_kernel = _kernels()
    device = coefs.device
    g, d = book.groups, book.channels
    c = _constants(book, device)
    quant = book.quantize is not None
    out = torch.empty((g, vectors, d), dtype=torch.uint16, device=device)
    p16 = params.contiguous().view(torch.float16) if params.numel() else torch.zeros(1, dtype=torch.float16,
                                                                                     device=device)
    if quant:
        cw = coefs.contiguous()
    else:
        cw = coefs.contiguous().view(torch.uint16) if coefs.numel() else torch.zeros(1, dtype=torch.uint16,
                                                                                      device=device)
    if vectors:
        grid = (g, triton.cdiv(vectors, BLOCK_M))
        decode_kernel[grid](cw, p16, cw, c["rot_t"], c["mean"], c["rank"], c["bits"], c["coef_pre"], c["code_pre"],
                            out, vectors, D=d, DPAD=_pow2(d), BLOCK=BLOCK_M, QUANT=quant,
                            BF16=dtype == torch.bfloat16, enable_fp_fusion=False)
    return out.view(dtype)
