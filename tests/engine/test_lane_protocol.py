"""Golden bytes of every control-lane frame, and malformed frames raise only ProtocolViolation."""

from __future__ import annotations

import random

import pytest

from kvferry.engine import lane
from kvferry.engine.errors import PayloadTooLarge, ProtocolViolation

HEAD = "4b56464c01{kind:02x}0000{tag}"
GOLDEN = {
    "hello": (7, lane.Hello("tok"), "11000000" + HEAD.format(kind=1, tag="07000000") + "0300746f6b"),
    "hello_empty": (0, lane.Hello(""), "0e000000" + HEAD.format(kind=1, tag="00000000") + "0000"),
    "welcome": (0, lane.Welcome(), "0c000000" + HEAD.format(kind=2, tag="00000000")),
    "request_post": (258, lane.Request("POST", "/v1/transfers?wait=1", b'{"a":1}'),
                     "2a000000" + HEAD.format(kind=3, tag="02010000") + "02" "1400" + b"/v1/transfers?wait=1".hex()
                     + b'{"a":1}'.hex()),
    "request_get": (3, lane.Request("GET", "/v1/transfers/ab"),
                    "1f000000" + HEAD.format(kind=3, tag="03000000") + "01" "1000" + b"/v1/transfers/ab".hex()),
    "reply": (3, lane.Reply(409, b'{"error":"TransferFailed"}'),
              "28000000" + HEAD.format(kind=4, tag="03000000") + "9901" + b'{"error":"TransferFailed"}'.hex()),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    tag, body, hexed = GOLDEN[name]
    raw = lane.pack(tag, body)
    assert raw.hex() == hexed
    assert lane.frame_size(raw[:4]) == len(raw) - 4
    assert lane.unpack(raw[4:]) == (tag, body)


@pytest.mark.parametrize("frame, why", [
    (b"KVFL\x01\x01\x00", "shorter than its header"),
    (b"KVFX\x01\x02\x00\x00\x00\x00\x00\x00", "magic"),
    (b"KVFL\x02\x02\x00\x00\x00\x00\x00\x00", "version 2"),
    (b"KVFL\x01\x02\x01\x00\x00\x00\x00\x00", "reserved"),
    (b"KVFL\x01\x09\x00\x00\x00\x00\x00\x00", "unknown lane frame kind 9"),
    (b"KVFL\x01\x01\x00\x00\x00\x00\x00\x00\x05\x00ab", "cut off in a string"),
    (b"KVFL\x01\x01\x00\x00\x00\x00\x00\x00\x02\x00\xff\xfe", "not UTF-8"),
    (b"KVFL\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00x", "after a HELLO"),
    (b"KVFL\x01\x02\x00\x00\x00\x00\x00\x00x", "no body"),
    (b"KVFL\x01\x03\x00\x00\x00\x00\x00\x00\x03\x00\x00", "known method"),
    (b"KVFL\x01\x04\x00\x00\x00\x00\x00\x00\x01", "without a status"),
])
def test_malformed_frames_are_refused_with_the_reason(frame, why):
    with pytest.raises(ProtocolViolation, match=why):
        lane.unpack(frame)


def test_frame_sizes_are_bounded_before_a_byte_of_the_frame_is_read():
    with pytest.raises(ProtocolViolation, match="shorter than its header"):
        lane.frame_size((11).to_bytes(4, "little"))
    with pytest.raises(PayloadTooLarge, match="over 100"):
        lane.frame_size((101).to_bytes(4, "little"), limit=100)
    assert lane.frame_size((100).to_bytes(4, "little"), limit=100) == 100
    with pytest.raises(PayloadTooLarge):
        lane.pack(1, lane.Request("POST", "/v1/transfers", bytes(lane.MAX_FRAME)))
    with pytest.raises(ProtocolViolation, match="GET and POST"):
        lane.pack(1, lane.Request("DELETE", "/v1/transfers/x"))
    with pytest.raises(ProtocolViolation, match="over 65535"):
        lane.pack(1, lane.Hello("x" * 65536))


def test_random_bytes_raise_only_protocol_violation():
    rng = random.Random(5)
    seeds = [lane.pack(tag, body)[4:] for tag, body, _ in GOLDEN.values()]
    for _ in range(3000):
        frame = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        frame = frame[:rng.randint(0, len(frame))] if rng.random() < 0.3 else frame
        try:
            lane.unpack(bytes(frame))
        except ProtocolViolation:
            pass
