"""tca-tbe's Triton kernels against the numpy reference, byte for byte, both ways. Plain
asserts and no pytest, so it also runs in a venv that has triton but no pytest:

    TRITON_INTERPRET=1 PYTHONPATH=. python -c \
        "from tests.codec.tcatbe_kernel_checks import check_kernels; check_kernels('cpu')"

``test_tcatbe_gpu.py`` calls it on CUDA, and on the CPU under the interpreter.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from kvferry.codec import CorruptFrame, FrameCodec, OutputMismatch
from kvferry.codec.tcatbe import cuda, gpu
from kvferry.codec.tcatbe.codec import decode_blocks, encode_reference, finish, read_header
from kvferry.codec.tcatbe.format import FRAME_ID, GROUP_TILES, Stream, padding_ranges


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.cpu().reshape(-1).view(torch.int16), b.cpu().reshape(-1).view(torch.int16)))


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """What the kernels must agree with the reference on: every BF16 pattern among KV over two
    groups of tiles, specials, both ends of the exponent range, odd sizes, random bits."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(150_000, generator=g) * 0.6).to(torch.bfloat16)
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    patterns = patterns[torch.randperm(1 << 16, generator=g)].view(torch.bfloat16)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFF81, 0x0001, 0x807F, 0x7F7F], dtype=np.uint16)
    body = kv[:4000].view(torch.int16).numpy().view(np.uint16).copy()
    body[::13] = np.resize(specials, body[::13].size)
    return {
        "patterns_in_kv": torch.cat([kv[:9000], patterns, kv[9000:]]).view(-1, 8),  # 3368 tiles
        "specials": bf16(body).view(40, 100),
        "window_at_0": bf16(np.resize(np.array([0, 0x8000, 1, 0x80FF, 0x0300, 0x037F], np.uint16), 333)),
        "window_at_249": bf16(np.resize(np.array([0x7F80, 0xFFC1, 0x7FFF, 0x7C00, 0xFE7F], np.uint16), 333)),
        "one": kv[:1].clone(),
        "tile_plus_one": kv[:65].clone(),
        "empty": kv[:0].clone().view(0, 4),
        "random_bits": torch.randint(-(1 << 15), 1 << 15, (5000,), dtype=torch.int16, generator=g).view(torch.bfloat16),
    }


STORED = {"random_bits", "one"}  # inputs whose tca-tbe frame would not be smaller


def _restream(frame: torch.Tensor, stream: int, index: int, fmt: str, value: int) -> torch.Tensor:
    header = read_header(frame)
    buf = bytearray(frame.cpu().numpy().tobytes())
    struct.pack_into(fmt, buf, header.offsets[stream] + index * struct.calcsize(fmt), value)
    return finish(torch.frombuffer(buf, dtype=torch.uint8), header, False)


def corruptions(frame: torch.Tensor) -> list[torch.Tensor]:
    """Frames whose header is fine but whose streams contradict each other."""
    h = read_header(frame)
    cases = [_restream(frame, Stream.TILES, 5, "<H", 0), _restream(frame, Stream.TILES, h.tiles - 1, "<H", 0xFFFF),
             _restream(frame, Stream.TILES, GROUP_TILES, "<H", 2), _restream(frame, Stream.GROUPS, 1, "<Q", 1 << 40),
             _restream(frame, Stream.GROUPS, 0, "<Q", 64), _restream(frame, Stream.BITMAPS, 21, "<Q", 0),
             _restream(frame, Stream.BITMAPS, 3 * (h.tiles - 1) + 1, "<Q", 1 << 63)]
    start, _ = padding_ranges(h)[0]
    padded = frame.clone()
    padded[start] = 9
    return cases + [padded]


def decoders(device: str) -> list[tuple[bool, bool]]:
    """(gpu.DECODE_CUDA, gpu.DECODE_BYTES) of every decode path there is on ``device``: both Triton
    kernels, and the CUDA kernels where CuPy is there."""
    triton_paths = [(False, True), (False, False)]
    return triton_paths + [(True, True)] if torch.device(device).type == "cuda" and cuda.available() else triton_paths


def _with(decoder: tuple[bool, bool], fn):
    default = gpu.DECODE_CUDA, gpu.DECODE_BYTES
    gpu.DECODE_CUDA, gpu.DECODE_BYTES = decoder
    try:
        return fn()
    finally:
        gpu.DECODE_CUDA, gpu.DECODE_BYTES = default


def check_blocks(device: str) -> None:
    """decode_blocks into scattered blocks, small (under a run of the CUDA kernel's lanes) and
    large, against the input; rows not named stay untouched, and a bad frame or a bad or repeated
    block id writes nothing."""
    flat = inputs()["patterns_in_kv"].reshape(-1)
    for block_elems in (128, 2048 + 64, 6 * 4096):
        count = min(flat.numel() // block_elems, 60)
        x = flat[:count * block_elems].reshape(count, block_elems // 8, 8)
        frame = encode_reference(x, checksum=False).to(device)
        ids = torch.randperm(count + 9, generator=torch.Generator().manual_seed(block_elems))[:count]
        for decoder in decoders(device):
            cache = torch.full((count + 9, *x.shape[1:]), 5.0, dtype=torch.bfloat16, device=device)
            _with(decoder, lambda: decode_blocks(frame, cache, ids.to(device)))
            assert same_bits(cache[ids.to(device)], x), f"blocks of {block_elems}: decode differs ({decoder})"
            rest = torch.ones(count + 9, dtype=torch.bool)
            rest[ids] = False
            assert bool((cache.cpu()[rest] == 5.0).all()), f"blocks of {block_elems}: other rows written ({decoder})"
            bad = corruptions(encode_reference(x, checksum=False))[0].to(device)
            cache.fill_(5.0)
            try:
                _with(decoder, lambda: decode_blocks(bad, cache, ids.to(device)))
            except CorruptFrame:
                pass
            else:
                raise AssertionError(f"blocks of {block_elems}: corrupt frame decoded ({decoder})")
            assert bool((cache.cpu() == 5.0).all()), f"blocks of {block_elems}: corrupt frame wrote ({decoder})"
            for wrong, error in ((count + 9, IndexError), (-1, IndexError), (int(ids[0]), OutputMismatch)):
                bad_ids = ids.clone()
                bad_ids[-1] = wrong
                try:
                    _with(decoder, lambda: decode_blocks(frame, cache, bad_ids.to(device)))
                except error:
                    pass
                else:
                    raise AssertionError(f"blocks of {block_elems}: id {wrong} taken ({decoder})")
                assert bool((cache.cpu() == 5.0).all()), f"blocks of {block_elems}: bad id {wrong} wrote ({decoder})"


def check_kernels(device: str) -> None:
    """Assert that the kernels on ``device`` write and read exactly the reference's bytes."""
    for name, x in inputs().items():
        for checksum in (False, True):
            cpu = encode_reference(x, checksum=checksum)
            dev = gpu.encode(x.to(device), checksum=checksum)
            assert dev.device.type == torch.device(device).type
            assert torch.equal(dev.cpu(), cpu), f"{name}: kernel frame != reference frame"
        coded = cpu[6].item() == FRAME_ID
        assert coded == (name not in STORED), name
        if coded:
            for decoder in decoders(device):
                out = torch.full(x.shape, 5.0, dtype=torch.bfloat16, device=device)
                _with(decoder, lambda: gpu.decode_into(cpu.to(device), read_header(cpu), out))
                assert same_bits(out, x), f"{name}: kernel decode differs ({decoder})"
        else:
            assert cpu[6].item() == int(FrameCodec.STORED)
    frame = encode_reference(inputs()["patterns_in_kv"], checksum=False)
    for decoder in decoders(device):
        shifted = torch.zeros(frame.numel() + 3, dtype=torch.uint8, device=device)[3:]  # not 16-byte aligned
        shifted.copy_(frame.to(device))
        out = torch.empty(inputs()["patterns_in_kv"].shape, dtype=torch.bfloat16, device=device)
        _with(decoder, lambda: gpu.decode_into(shifted, read_header(frame), out))
        assert same_bits(out, inputs()["patterns_in_kv"]), f"unaligned frame ({decoder})"
        for i, bad in enumerate(corruptions(frame)):
            out = torch.full((26942, 8), 5.0, dtype=torch.bfloat16, device=device)
            try:
                _with(decoder, lambda: gpu.decode_into(bad.to(device), read_header(bad), out))
            except CorruptFrame:
                pass
            else:
                raise AssertionError(f"corruption {i} decoded ({decoder})")
            assert bool((out.cpu() == 5.0).all()), f"corruption {i}: out was written ({decoder})"
    check_blocks(device)
    print("tca-tbe kernels match the reference on", device)


if __name__ == "__main__":
    check_kernels("cuda" if torch.cuda.is_available() else "cpu")
