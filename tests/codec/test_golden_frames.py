"""Frozen inputs and their exact frame bytes: any change to the format breaks these."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry import codec
from kvferry.codec.format import FrameCodec
from tests.conftest import from_bytes

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
CASES = {"bfloat16": (torch.bfloat16, False), "float16": (torch.float16, True),
         "float8_e5m2": (torch.float8_e5m2, False), "float8_e4m3fn": (torch.float8_e4m3fn, False),
         "float8_e4m3fn_narrow": (torch.float8_e4m3fn, False)}


@pytest.mark.parametrize("name", CASES)
def test_encode_reproduces_golden_bytes(name):
    dtype, checksum = CASES[name]
    x = from_bytes((GOLDEN / f"{name}.input.bin").read_bytes(), dtype)
    golden = (GOLDEN / f"{name}.frame.bin").read_bytes()
    assert codec.encode(x, checksum=checksum).numpy().tobytes() == golden


@pytest.mark.parametrize("name", CASES)
def test_golden_decodes_to_input(name):
    dtype, _ = CASES[name]
    expected = (GOLDEN / f"{name}.input.bin").read_bytes()
    frame = torch.frombuffer(bytearray((GOLDEN / f"{name}.frame.bin").read_bytes()), dtype=torch.uint8)
    y = codec.decode(frame)
    assert y.dtype == dtype
    assert y.view(torch.uint8).numpy().tobytes() == expected


def test_golden_codecs():
    codecs = {name: _header(name).codec for name in CASES}
    assert codecs["float8_e4m3fn"] == FrameCodec.STORED
    assert all(c == FrameCodec.SPLITZIP for name, c in codecs.items() if name != "float8_e4m3fn")


def _header(name: str) -> codec.Header:
    frame = (GOLDEN / f"{name}.frame.bin").read_bytes()
    return codec.read_header(torch.frombuffer(bytearray(frame), dtype=torch.uint8))


def test_golden_header_fields():
    frame = (GOLDEN / "bfloat16.frame.bin").read_bytes()
    assert frame[:4] == b"KVFZ" and frame[4:6] == b"\x01\x00"
    header = codec.read_header(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
    assert header.codec == FrameCodec.SPLITZIP and header.shape == (2500,) and header.chunk == 1024
    assert header.escapes > 0 and header.offsets[0] == codec.HEADER_SIZE
    assert all(offset % 16 == 0 for offset in header.offsets)
