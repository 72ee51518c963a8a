"""Golden bytes of every peer message, and malformed messages raise only ProtocolViolation."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvferry.engine import peer
from kvferry.engine.blocks import Blocks, Range
from kvferry.engine.errors import ProtocolViolation

TID = "00112233445566778899aabbccddeeff"
HEAD = "4b56465008{kind:02x}000000112233445566778899aabbccddeeff"
GOLDEN = {
    "announce": (peer.Message(TID, peer.Announce(
        "splitzip", "bfloat16", Blocks(ranges=(Range(4, 3, 2),)),
        (peer.PairLayout("l0", (2, 16), 8), peer.PairLayout("l1", (2, 16), 8)), "kb", bytes(range(8)))),
        HEAD.format(kind=1) + "0873706c69747a69700862666c6f61743136026b620001020304050607010100000004000000030000"
        "00020000000200026c300202000000100000000800000000026c31020200000010000000080000000000000000"
        + "00" * 16 + "00"),
    "announce_ids": (peer.Message(TID, peer.Announce("raw", "float16", Blocks(ids=(5, 1)),
                                                      (peer.PairLayout("d", (4,), 1, "r"),), inline_chunks=1,
                                                      host=bytes(range(16)))),
                     HEAD.format(kind=1) + "0372617707666c6f617431360000000000000000000002000000050000000100000001"
                     "000164010400000001000000017201000000000102030405060708090a0b0c0d0e0f00"),
    "announce_written": (peer.Message(TID, peer.Announce("raw", "bfloat16", Blocks(ids=(2,)),
                                                          (peer.PairLayout("d", (4,), 1),), host=bytes(range(16)),
                                                          flags=peer.FLAG_WRITTEN)),
                         HEAD.format(kind=1) + "037261770862666c6f6174313600" + "00" * 8 + "00" + "0100000002000000"
                         "0100" "0164" "01" "04000000" "01000000" "00" "00000000" "000102030405060708090a0b0c0d0e0f" "01"),
    "announce_writing": (peer.Message(TID, peer.Announce("raw", "bfloat16", Blocks(ids=(2,)),
                                                          (peer.PairLayout("d", (4,), 1),), host=bytes(range(16)),
                                                          flags=peer.FLAG_WRITING, event=bytes(range(64)),
                                                          event_gpu=bytes([9] * 16))),
                         HEAD.format(kind=1) + "037261770862666c6f6174313600" + "00" * 8 + "00" + "0100000002000000"
                         "0100" "0164" "01" "04000000" "01000000" "00" "00000000"
                         "000102030405060708090a0b0c0d0e0f" "04" + bytes(range(64)).hex() + "09" * 16),
    "announce_spread": (peer.Message(TID, peer.Announce("raw", "bfloat16", Blocks(ids=(3, 1), spread=(64, 300)),
                                                         (peer.PairLayout("d", (4,), 1),))),
                        HEAD.format(kind=1) + "037261770862666c6f6174313600" + "00" * 8 + "02" "02000000" "03000000"
                        "01000000" "40000000" "2c010000" "0100" "0164" "01" "04000000" "01000000" "00" "00000000"
                        + "00" * 16 + "00"),
    "announce_tapered": (peer.Message(TID, peer.Announce("splitzip", "bfloat16", Blocks(ids=(2,)),
                                                          (peer.PairLayout("d", (4,), 1),), flags=peer.FLAG_TAPERED)),
                         HEAD.format(kind=1) + "0873706c69747a69700862666c6f6174313600" + "00" * 8 + "00" + "01000000"
                         "02000000" "0100" "0164" "01" "04000000" "01000000" "00" "00000000" + "00" * 16 + "02"),
    "chunk": (peer.Message(TID, peer.Chunk(3, b"KVFZ\x01")), HEAD.format(kind=7) + "030000004b56465a01"),
    "accept": (peer.Message(TID, peer.Accept()), HEAD.format(kind=2) + "0000"),
    "accept_ipc": (peer.Message(TID, peer.Accept((peer.Target(bytes(range(64)), 4096, bytes([9] * 16), 80),))),
                   HEAD.format(kind=2) + "0100" + bytes(range(64)).hex() + "0010000000000000" + "09" * 16 + "50000000"
                   + "00" * 16),
    "written": (peer.Message(TID, peer.Written(7)), HEAD.format(kind=8) + "07000000"),
    "accept_shm": (peer.Message(TID, peer.Accept((peer.Target(b"kvferry-d".ljust(64, b"\0"), 0, peer.HOST_MEMORY, 3,
                                                             bytes(range(16))),))),
                   HEAD.format(kind=2) + "0100" + b"kvferry-d".hex() + "00" * 55 + "00" * 8 + "00" * 16 + "03000000"
                   + bytes(range(16)).hex()),
    "revoke": (peer.Message(peer.LINK_ID, peer.Revoke("dst")),
               "4b564650080900" + "00" * 17 + "03647374"),
    "revoked": (peer.Message(peer.LINK_ID, peer.Revoked("dst")),
                "4b564650080a00" + "00" * 17 + "03647374"),
    "reject": (peer.Message(TID, peer.Reject("NotFound", "no region named 'x'")),
               HEAD.format(kind=3) + "084e6f74466f756e6413006e6f20726567696f6e206e616d656420277827"),
    "done": (peer.Message(TID, peer.Done(3, 1024, 900)), HEAD.format(kind=4) + "0300000000040000000000008403000000000000"),
    "cancel": (peer.Message(TID, peer.Cancel("cancelled by request")),
               HEAD.format(kind=5) + "140063616e63656c6c65642062792072657175657374"),
    "error": (peer.Message(TID, peer.Error("BadRequest", "chunk 0: CorruptFrame")),
              HEAD.format(kind=6) + "0a4261645265717565737415006368756e6b20303a20436f72727570744672616d65"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    message, hexed = GOLDEN[name]
    assert peer.pack(message).hex() == hexed
    assert peer.unpack(bytes.fromhex(hexed)) == message


def test_header_fields():
    raw = bytes.fromhex(GOLDEN["written"][1])
    assert len(raw) == peer.HEADER_SIZE + 4 and peer.HEADER_SIZE == 24 and raw[:4] == b"KVFP" and raw[4] == peer.VERSION
    with pytest.raises(ProtocolViolation, match="version"):
        peer.unpack(raw[:4] + b"\x02" + raw[5:])  # version 2 had no standing leases
    with pytest.raises(ProtocolViolation, match="magic"):
        peer.unpack(b"XXXX" + raw[4:])
    with pytest.raises(ProtocolViolation, match="kind"):
        peer.unpack(raw[:5] + b"\x63" + raw[6:])
    with pytest.raises(ProtocolViolation, match="after"):
        peer.unpack(raw + b"\0")


def test_truncated_and_mutated_messages_raise_only_protocol_violation():
    rng = random.Random(7)
    for _, hexed in GOLDEN.values():
        raw = bytes.fromhex(hexed)
        complete_at = peer.HEADER_SIZE + 4 if raw[5] == peer.Kind.CHUNK else len(raw)  # a frame is any length
        for cut in range(complete_at):
            with pytest.raises(ProtocolViolation):
                peer.unpack(raw[:cut])
        for _ in range(300):
            mutated = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            try:
                peer.unpack(bytes(mutated))
            except ProtocolViolation:
                pass


def test_tags_and_plan_follow_from_the_announce():
    assert peer.chunk_tag(TID, 0) != peer.chunk_tag(TID, 1)
    assert peer.chunk_tag(TID, 3) == peer.chunk_tag(TID, 3)
    assert peer.plan_chunks(5, (2, 5)) == [(0, 0, 2), (0, 2, 2), (0, 4, 1), (1, 0, 5)]


TAPERED = {
    (64, (16,)): [(0, 0, 2), (0, 2, 14), (0, 16, 16), (0, 32, 16), (0, 48, 14), (0, 62, 2)],
    (20, (16,)): [(0, 0, 2), (0, 2, 14), (0, 16, 4)],  # a last chunk too small to split
    (16, (16,)): [(0, 0, 2), (0, 2, 13), (0, 15, 1)],  # one chunk: split at both ends
    (7, (16,)): [(0, 0, 7)],
    (40, (16, 8)): [(0, 0, 2), (0, 2, 14), (0, 16, 16), (0, 32, 8), (1, 0, 8), (1, 8, 8), (1, 16, 8), (1, 24, 8),
                    (1, 32, 7), (1, 39, 1)],
}


@pytest.mark.parametrize("blocks, per_chunk", sorted(TAPERED))
def test_a_tapered_plan_splits_its_first_and_last_chunks_and_covers_the_same_blocks(blocks, per_chunk):
    tapered = peer.plan_chunks(blocks, per_chunk, tapered=True)
    assert tapered == TAPERED[blocks, per_chunk]

    def covered(plan):
        return [(pair, start + i) for pair, start, count in plan for i in range(count)]

    assert covered(tapered) == covered(peer.plan_chunks(blocks, per_chunk))  # the same blocks, in order


def test_unpackable_ids_are_refused():
    with pytest.raises(ProtocolViolation):
        peer.pack(peer.Message("not-hex", peer.Accept()))


def test_messages_parse_the_same_from_the_transports_bytearray():
    """The transport hands each message over in its own bytearray: fields come out as bytes (an
    IPC handle keys the mapper's cache), and a chunk's frame is a view of that buffer, not a copy."""
    for name, (message, _) in GOLDEN.items():
        parsed = peer.unpack(bytearray(peer.pack(message)))
        assert parsed == message, name
        if isinstance(parsed.body, peer.Accept):
            assert all(hash(t.handle) is not None and isinstance(t.device_uuid, bytes) for t in parsed.body.targets)
    buffer = bytearray(peer.pack(peer.Message(TID, peer.Chunk(3, b"frame"))))
    chunk = peer.unpack(buffer).body
    buffer[-1] = ord("E")
    assert bytes(chunk.frame) == b"framE"


def test_unknown_announce_flags_are_refused():
    raw = bytearray.fromhex(GOLDEN["announce_written"][1])
    raw[-1] = 0x08
    with pytest.raises(ProtocolViolation, match="flags"):
        peer.unpack(bytes(raw))


def test_an_announce_is_written_or_being_written_and_only_a_writing_one_carries_an_event():
    writing = bytearray.fromhex(GOLDEN["announce_writing"][1])
    flags_at = len(writing) - peer.EVENT_BYTES - 16 - 1
    assert writing[flags_at] == peer.FLAG_WRITING
    both = bytearray(writing)
    both[flags_at] = peer.FLAG_WRITING | peer.FLAG_WRITTEN
    with pytest.raises(ProtocolViolation, match="both"):
        peer.unpack(bytes(both))
    with pytest.raises(ProtocolViolation, match="truncated"):
        peer.unpack(bytes(writing[:-1]))  # an event cut short
    with pytest.raises(ProtocolViolation, match="after"):
        peer.unpack(bytes.fromhex(GOLDEN["announce_written"][1]) + bytes(80))  # an event it does not flag
    message = GOLDEN["announce_writing"][0]
    for body in (dataclasses.replace(message.body, event=b"short"),
                 dataclasses.replace(message.body, flags=0),
                 dataclasses.replace(message.body, event_gpu=b"")):
        with pytest.raises(ProtocolViolation, match="event"):
            peer.pack(peer.Message(TID, body))


def test_announces_sharing_their_tail_keep_their_own_ids_and_blocks_and_a_bad_tail_is_refused_each_time():
    """The part after the block list is parsed once per distinct tail; what comes before it is
    each message's own, and a tail that does not parse is never kept."""
    layout = peer.PairLayout("dst", (32, 2, 16, 8, 128), 1)
    sent = [peer.Message(f"{i:032x}", peer.Announce("raw", "bfloat16", Blocks(ids=(i, 2 * i + 1)), (layout,),
                                                    host=bytes(range(16)), flags=peer.FLAG_WRITTEN))
            for i in range(1, 4)]
    for message in sent:
        assert peer.unpack(peer.pack(message)) == message
    damaged = bytearray(peer.pack(sent[0]))
    damaged[-1] = peer.FLAG_WRITTEN | 0x80  # an unknown flag, in the tail
    for _ in range(2):
        with pytest.raises(ProtocolViolation, match="unknown announce flags"):
            peer.unpack(bytes(damaged))
    assert peer.unpack(peer.pack(sent[0])) == sent[0]


def test_long_announce_tails_are_parsed_each_time_not_kept():
    """A peer's announces of many pairs (a megabyte each, at most) must not stay in the parse
    cache: 256 of them would hold gigabytes. Short tails, the hot path's, are kept."""
    import uuid

    def announce(pairs: int, tag: str) -> bytes:
        layouts = tuple(peer.PairLayout(f"r{tag}{i}"[:255], (512,), 1) for i in range(pairs))
        return peer.pack(peer.Message(uuid.uuid4().hex, peer.Announce("raw", "bfloat16", Blocks.of([0]), layouts)))

    peer._short_tail.cache_clear()
    for k in range(20):
        assert len(peer.unpack(announce(200, f"{k}-")).body.pairs) == 200  # tails of ~2 KiB
    assert peer._short_tail.cache_info().currsize == 0
    for _ in range(3):
        peer.unpack(announce(1, "short"))
    info = peer._short_tail.cache_info()
    assert info.currsize == 1 and info.hits == 2
