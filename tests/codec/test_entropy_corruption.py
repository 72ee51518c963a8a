"""Corrupt entropy frames: every failure is ``CorruptFrame`` (never another exception), and
nothing is written. With the stream CRC every change is caught; without it the decoder's own
checks (header, tables, map, counts, word pointers, padding) still keep every failure a
``CorruptFrame`` and every decode in bounds."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from kvferry import codec
from kvferry.codec import entropy
from kvferry.codec.checksum import crc32c
from kvferry.codec.entropy.format import _BODY, HEADER_SIZE, Stream
from tests.codec.test_entropy_roundtrip import kv_like, with_specials


@pytest.fixture(scope="module")
def frames() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        x = with_specials(kv_like((4, 256, 32), dtype, seed=11), seed=12, rate=0.01)
        book = entropy.calibrate(kv_like((4, 256, 32), dtype, seed=13), token_axis=1, tables=3)
        for checksum in (True, False):
            frame = entropy.encode(x, book, checksum=checksum, chunk=4096)
            assert frame[6].item() == entropy.FRAME_ID
            out[f"{dtype}-{checksum}"] = (x, frame)
    return out


def decode_or_corrupt(frame: torch.Tensor) -> torch.Tensor | None:
    """The decoded tensor, or None if decode raised CorruptFrame (anything else propagates)."""
    try:
        return entropy.decode(frame)
    except codec.CorruptFrame:
        return None


@pytest.mark.parametrize("name", ["torch.bfloat16-True", "torch.float8_e4m3fn-True"])
def test_every_header_byte_and_sampled_stream_bytes_are_caught(name, frames):
    _, frame = frames[name]
    rng = random.Random(1)
    positions = list(range(HEADER_SIZE)) + rng.sample(range(HEADER_SIZE, frame.numel()), 150)
    for pos in positions:
        bad = frame.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(codec.CorruptFrame):
            entropy.decode(bad)


@pytest.mark.parametrize("name", ["torch.bfloat16-True", "torch.bfloat16-False"])
def test_truncated_and_extended_frames(name, frames):
    _, frame = frames[name]
    for size in (0, 3, 6, 7, 100, HEADER_SIZE - 1, HEADER_SIZE, frame.numel() // 2, frame.numel() - 1):
        with pytest.raises(codec.CorruptFrame):
            entropy.decode(frame[:size].clone())
    with pytest.raises(codec.CorruptFrame):
        entropy.decode(torch.cat([frame, torch.zeros(16, dtype=torch.uint8)]))
    for bad in (frame.view(torch.int8), frame.view(1, -1), [1, 2, 3]):
        with pytest.raises(codec.CorruptFrame):
            entropy.decode(bad)


@pytest.mark.parametrize("name", ["torch.bfloat16-False", "torch.float8_e4m3fn-False"])
def test_unchecksummed_stream_damage_never_escapes_as_another_error(name, frames):
    """Without a stream CRC a flipped bit in a code can make another code of the same length
    (one element changes) or of another length (the lane's stream slips and may realign), and
    raw bits pass through unchecked: such damage decodes to a tensor of the right shape. A flip
    in the counts always breaks their sum; nothing raises anything but CorruptFrame."""
    x, frame = frames[name]
    h = entropy.read_header(frame)
    rng = random.Random(2)
    caught = {stream: 0 for stream in range(len(h.offsets))}
    flips = dict(caught)
    for _ in range(300):
        bad = frame.clone()
        pos = rng.randrange(HEADER_SIZE, frame.numel())
        bad[pos] ^= 1 << rng.randrange(8)
        stream = max(i for i, o in enumerate(h.offsets) if o <= pos)
        flips[stream] += 1
        y = decode_or_corrupt(bad)
        if y is None:
            caught[stream] += 1
        else:
            assert y.shape == x.shape and y.dtype == x.dtype, f"byte {pos}"
    assert caught[Stream.COUNTS] == flips[Stream.COUNTS]
    assert caught[Stream.WORDS] > 0


def _forge(frame: torch.Tensor, **fields) -> torch.Tensor:
    """``frame`` with header fields replaced and both CRCs recomputed: only structural checks remain."""
    names = ["magic", "version", "codec", "dtype", "ndim", "code_bits", "flags", "tables", "lanes", "reserved",
             "chunk", "outer", "tokens", "inner", "numel"] + [f"shape{i}" for i in range(8)] + \
            [f"len{i}" for i in range(5)] + ["reserved2", "stream_crc"]
    buf = bytearray(frame.numpy().tobytes())
    values = dict(zip(names, _BODY.unpack(bytes(buf[:_BODY.size]))))
    values.update(fields)
    body = _BODY.pack(*[values[n] for n in names])
    if values["flags"] & 1 and "stream_crc" not in fields:
        body = _BODY.pack(*[values[n] for n in names[:-1]], crc32c(bytes(buf[HEADER_SIZE:])))
    buf[:HEADER_SIZE] = body + struct.pack("<I", crc32c(body))
    return torch.frombuffer(buf, dtype=torch.uint8)


def test_forged_headers_raise_corrupt_frame(frames):
    _, frame = frames["torch.bfloat16-False"]
    h = entropy.read_header(frame)
    forgeries = [
        {"version": 1}, {"version": 3}, {"codec": 1}, {"dtype": 9}, {"dtype": 2}, {"ndim": 9}, {"code_bits": 9},
        {"code_bits": 11}, {"flags": 2}, {"tables": 0}, {"tables": h.tables + 1}, {"lanes": 16},
        {"reserved": 1}, {"chunk": 1000}, {"chunk": 0}, {"chunk": 2048}, {"outer": 0}, {"inner": 1 << 20},
        {"outer": 8, "inner": 16}, {"numel": h.numel + 1}, {"shape0": 5}, {"len0": h.lengths[0] + 2}, {"len1": 0},
        {"len3": h.lengths[3] + 4}, {"len3": h.lengths[3] - 4}, {"len3": h.lengths[3] + 2}, {"len4": 0},
        {"reserved2": 1},
        {"stream_crc": 5}, {"flags": 1, "stream_crc": 0},
    ]
    for fields in forgeries:
        with pytest.raises(codec.CorruptFrame):
            entropy.decode(_forge(frame, **fields))


def test_forged_streams_raise_corrupt_frame(frames):
    """Checksummed frames whose streams were rewritten (CRC recomputed): the structural checks."""
    _, frame = frames["torch.bfloat16-True"]
    h = entropy.read_header(frame)

    def patched(stream: int, at: int, data: bytes) -> torch.Tensor:
        bad = frame.clone()
        o = h.offsets[stream] + at
        bad[o:o + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return _forge(bad)

    per = (h.sym.alphabet + 7) // 8  # a table's bitmap bytes, then its code lengths
    cases = [
        patched(Stream.TABLES, 0, bytes(per)),                  # a table with no symbols (lengths shift)
        patched(Stream.TABLES, per - 1, bytes([0xff])),         # symbols past the alphabet
        patched(Stream.TABLES, per, bytes([0x11])),             # codes that are not complete
        patched(Stream.TABLES, per, bytes([0xbb])),             # codes longer than CODE_BITS
        patched(Stream.MAP, 0, bytes([0xff])),                  # a table that does not exist
        patched(Stream.COUNTS, 0, struct.pack("<I", 1 << 30)),  # count over the cap
        patched(Stream.COUNTS, 0, struct.pack("<I", 3)),        # counts no longer add up
        patched(Stream.WORDS, 0, b"\xff\xff\xff\xff"),          # a lane's stream slips
        patched(Stream.WORDS, h.lengths[Stream.WORDS] - 4, b"\x00\x00\x00\x01"),  # padding after the last code
    ]
    for bad in cases:
        with pytest.raises(codec.CorruptFrame):
            entropy.decode(bad)


def test_bad_frames_write_nothing(frames):
    x, frame = frames["torch.bfloat16-True"]
    cache = torch.zeros((6, *x.shape[1:]), dtype=x.dtype)  # the frame holds 4 blocks
    bad = frame.clone()
    bad[-1] ^= 0x10
    with pytest.raises(codec.CorruptFrame):
        entropy.decode_blocks(bad, cache, torch.tensor([0, 2, 3, 5]))
    out = torch.zeros_like(x)
    with pytest.raises(codec.CorruptFrame):
        entropy.decode(bad, out=out)
    assert not cache.view(torch.int16).any() and not out.view(torch.int16).any()
    # A SplitZip frame is not an entropy frame; the registry sends it to its own codec.
    sz = codec.encode(x)
    with pytest.raises(codec.CorruptFrame):
        entropy.decode(sz)
    assert codec.codec_of(sz).name == "splitzip"
