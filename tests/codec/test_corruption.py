"""Damaged frames raise CorruptFrame or decode to the declared dtype and shape; nothing else."""

from __future__ import annotations

import random

import pytest
import torch

from kvferry import codec
from kvferry.codec.format import HEADER_SIZE, FrameCodec
from kvferry.codec.frames import _encode

CASES = 1500


def _frames(checksum: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(3, 1100, generator=gen)
    kv[0, ::50] = 1e30  # escapes
    frames = [
        codec.encode(kv.to(torch.bfloat16), checksum=checksum),
        codec.encode(kv.to(torch.float16), checksum=checksum),
        codec.encode(kv.to(torch.float8_e5m2), checksum=checksum),
        _encode(kv.to(torch.float8_e4m3fn), None, checksum=checksum, chunk=64, force=FrameCodec.SPLITZIP),
        codec.encode(torch.randint(0, 256, (700,), dtype=torch.uint8).view(torch.float8_e4m3fn), checksum=checksum),
        codec.encode(torch.empty(0, 5, dtype=torch.bfloat16), checksum=checksum),
    ]
    assert {codec.read_header(f).codec for f in frames} == {FrameCodec.SPLITZIP, FrameCodec.STORED}
    return frames


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    kind = rng.choice(["flip", "flip", "bytes", "truncate", "extend", "header"])
    data = bytearray(frame)
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == "bytes":
        i = rng.randrange(len(data))
        for j in range(i, min(len(data), i + rng.randint(1, 8))):
            data[j] = rng.randrange(256)
    elif kind == "header":
        data[rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return bytes(data)


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_random_damage(checksum):
    rng = random.Random(1234 + checksum)
    raised = decoded = 0
    for frame in _frames(checksum):
        header = codec.read_header(frame)
        original = bytes(frame.tolist())
        for _ in range(CASES):
            damaged = _mutate(rng, original)
            if damaged == original:
                continue
            tensor = torch.frombuffer(bytearray(damaged), dtype=torch.uint8) if damaged else torch.empty(0, dtype=torch.uint8)
            sentinel = torch.full((header.numel,), 3.0).to(header.layout.dtype)
            before = sentinel.clone()
            try:
                out = codec.decode(tensor, out=sentinel)
            except codec.CorruptFrame:
                raised += 1
                assert torch.equal(sentinel.view(torch.uint8), before.view(torch.uint8)), "wrote before failing"
                continue
            decoded += 1
            assert not checksum, "a damaged frame with a stream checksum decoded"
            assert out.dtype == header.layout.dtype and out.numel() == header.numel
    assert raised > 0
    if not checksum:
        assert decoded > 0  # damage inside the residual stream is undetectable without a checksum


def test_not_a_frame():
    for bad in [torch.zeros(10, dtype=torch.uint8), torch.zeros(200, dtype=torch.int16),
                torch.zeros(2, 200, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)]:
        with pytest.raises(codec.CorruptFrame):
            codec.decode(bad)


def test_reasons_are_specific():
    frame = codec.encode(torch.randn(4000).to(torch.bfloat16))
    with pytest.raises(codec.CorruptFrame, match="magic"):
        bad = frame.clone(); bad[0] = ord("X"); codec.decode(bad)
    with pytest.raises(codec.CorruptFrame, match="header checksum"):
        bad = frame.clone(); bad[20] ^= 1; codec.decode(bad)
    with pytest.raises(codec.CorruptFrame, match="frame is"):
        codec.decode(frame[:-1])
