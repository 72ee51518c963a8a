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
from kvferry.codec.entropy import gpu, reference
from kvferry.codec.entropy.codec import encode_reference
from kvferry.codec.entropy.format import _BODY, HEADER_SIZE, MAX_CHUNK, Stream
from tests.codec.test_entropy_roundtrip import kv_like, with_specials
from tests.conftest import bits_equal


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


def _tables_of(frame: torch.Tensor) -> tuple[entropy.EntropyHeader, bytes, bytes]:
    h = entropy.read_header(frame)
    tables, cmap = (frame[h.offsets[s]:h.offsets[s] + h.lengths[s]].numpy().tobytes()
                    for s in (Stream.TABLES, Stream.MAP))
    return h, tables, cmap


def test_a_period_longer_than_the_frame_costs_only_what_its_elements_reach(monkeypatch):
    """A header may name a period of up to 2**48 positions, and a codebook learned on more
    blocks than a frame holds names one longer than the frame: the tables a decoder builds, on
    the host or the device, cover the positions its elements reach (a period under twice them)."""
    x = kv_like((64, 32), torch.bfloat16, seed=21)
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=1), token_axis=None, tables=2)
    assert book.geometry == entropy.Geometry(1, 4, 32)  # contexts by channel
    frame = entropy.encode(x, book, checksum=False, chunk=4096)
    assert frame[6].item() == entropy.FRAME_ID
    forged = _forge(frame, tokens=1 << 22)  # a period of 2**27: the same contexts for every element
    h, tables, cmap = _tables_of(forged)
    assert h.geometry.period == 1 << 27 and h.numel == 2048
    ct = gpu._frame_tables(h, tables, cmap)  # what the device's tables are built from
    assert ct.geometry.period <= 2 * h.numel and ct.context_map.size == ct.geometry.contexts
    monkeypatch.setattr(gpu, "_device_limits", lambda index: (1, 48 << 10))
    tabs = gpu._tables_on(ct, torch.device("cpu"))  # the device's tables, built on the host here
    assert tabs.ptab.numel() <= 2 * h.numel
    assert bits_equal(entropy.decode(forged), x)


def test_frames_of_one_codebook_get_tables_for_their_own_elements():
    """Frames repeating one codebook's tables share parsed tables only where their elements
    reach the same positions of its period."""
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=1), token_axis=1, tables=4)
    for tokens in (256, 40, 512, 40):
        x = kv_like((4, tokens, 32), torch.bfloat16, seed=tokens)
        h, tables, cmap = _tables_of(entropy.encode(x, book, checksum=False, chunk=4096))
        assert h.geometry == book.geometry
        ct = gpu._frame_tables(h, tables, cmap)
        assert ct.geometry == book.geometry.for_elements(x.numel())
        assert (ct.geometry == book.geometry) == (tokens >= 256)


def test_chunks_larger_than_the_encoders_write_are_refused():
    """The reference decoder walks a chunk's steps one by one: a frame's chunk is at most the
    largest the encoders write (DEFAULT_CHUNK)."""
    assert MAX_CHUNK == entropy.DEFAULT_CHUNK
    x = kv_like((64, 32), torch.bfloat16, seed=21)
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=1), token_axis=None, tables=2)
    with pytest.raises(codec.InvalidArgument):
        entropy.encode(x, book, chunk=2 * MAX_CHUNK)
    frame = encode_reference(x, book, checksum=False, chunk=2 * MAX_CHUNK)  # no encoder writes this
    assert frame[6].item() == entropy.FRAME_ID
    with pytest.raises(codec.CorruptFrame, match="chunk"):
        entropy.decode(frame)
    assert bits_equal(entropy.decode(encode_reference(x, book, checksum=False, chunk=MAX_CHUNK)), x)


def test_decode_walks_only_the_steps_a_frames_elements_take(monkeypatch):
    """A small frame in a large chunk costs the reference decoder its elements' steps, not the
    chunk's: 2048 elements are 64 steps of 32 lanes."""
    x = kv_like((64, 32), torch.bfloat16, seed=21)
    book = entropy.calibrate(kv_like((4, 256, 32), torch.bfloat16, seed=1), token_axis=None, tables=2)
    frame = entropy.encode(x, book, checksum=False, chunk=MAX_CHUNK)
    assert frame[6].item() == entropy.FRAME_ID
    walked = []
    segments = reference.segments
    monkeypatch.setattr(reference, "segments", lambda steps: walked.append(steps) or segments(steps))
    assert bits_equal(entropy.decode(frame), x)
    assert walked == [64]


def test_more_elements_than_the_words_can_code_are_refused():
    """Every element takes a code of one bit or more: a header naming more elements than 32 a
    word of its word stream describes a frame no decode could finish, and costs nothing more."""
    x = torch.full((4096,), 0.5).to(torch.float8_e4m3fn)
    x[::97] = 1.0
    frame = entropy.encode(x, None, checksum=False, chunk=entropy.DEFAULT_CHUNK)
    h = entropy.read_header(frame)
    assert h.lengths[Stream.RAW] == 0  # FP8: the symbols are the whole bytes
    words = h.lengths[Stream.WORDS] // 4
    assert bits_equal(entropy.decode(_forge(frame, numel=4096, shape0=4096)), x)
    with pytest.raises(codec.CorruptFrame, match="word stream"):
        entropy.read_header(_forge(frame, numel=32 * words + 32, shape0=32 * words + 32))
