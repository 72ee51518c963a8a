"""Golden bytes and validation of the transport's message header."""

from __future__ import annotations

import pytest

from kvferry.transport import ProtocolError, wire
from kvferry.transport.wire import Message, MessageType

GOLDEN = bytes.fromhex(
    "4b56465404050100" "0700000000000000" "0010000000000000" "0004000000000000"
    "0020000000000000" "00000000")


def test_golden_data_header():
    message = Message(MessageType.DATA, tag=7, offset=4096, length=1024, total=8192, flags=1)
    packed = message.pack()
    assert len(packed) == wire.HEADER_SIZE == 48
    assert packed[:44] == GOLDEN
    assert wire.unpack(packed) == message


@pytest.mark.parametrize("position", range(48))
def test_any_flipped_byte_is_rejected(position):
    packed = bytearray(Message(MessageType.RTS, tag=3, total=10).pack())
    packed[position] ^= 0x40
    with pytest.raises(ProtocolError):
        wire.unpack(bytes(packed))


def test_data_beyond_total_and_wrong_size():
    with pytest.raises(ProtocolError, match="beyond"):
        wire.unpack(Message(MessageType.DATA, tag=1, offset=10, length=10, total=15).pack())
    with pytest.raises(ProtocolError, match="48"):
        wire.unpack(b"KVFT")


def test_golden_msg_and_handshake_headers():
    # MSG: type 9, length 5; AUTH: type 8, empty; HELLO: type 1, a 32-byte nonce follows.
    assert Message(MessageType.MSG, length=5).pack()[:32].hex() == (
        "4b56465404090000" "0000000000000000" "0000000000000000" "0500000000000000")
    assert Message(MessageType.AUTH).pack()[:8].hex() == "4b56465404080000"
    assert Message(MessageType.HELLO, length=32).pack()[24:32] == (32).to_bytes(8, "little")


def test_oversized_msg_and_handshake_payloads_are_rejected():
    with pytest.raises(ProtocolError, match="MSG"):
        wire.unpack(Message(MessageType.MSG, length=wire.MAX_MESSAGE_BYTES + 1).pack())
    with pytest.raises(ProtocolError, match="HELLO"):
        wire.unpack(Message(MessageType.HELLO, length=wire.NONCE_BYTES + wire.MAX_OFFER_BYTES + wire.MAC_BYTES + 1).pack())


def test_handshake_macs_are_hmac_sha256_over_the_transcript_golden():
    import hashlib
    import hmac

    from kvferry.transport import handshake

    got = handshake.mac(b"secret", b"kvferry/3 acceptor", bytes(range(32)))
    want = hmac.new(b"secret", b"kvferry/3 acceptor" + hashlib.sha256(bytes(range(32))).digest(), "sha256")
    assert got.hex() == want.hexdigest()


def test_digest_flag_rules_and_an_older_version_is_named():
    message = Message(MessageType.DATA, tag=7, offset=0, length=3, total=3, flags=wire.FLAG_DIGEST)
    packed = message.pack()
    assert packed[6:8] == (8).to_bytes(2, "little") and packed[40:44] == bytes(4)
    assert wire.unpack(packed) == message
    with pytest.raises(ProtocolError, match="digest"):
        wire.unpack(Message(MessageType.ACK, tag=7, flags=wire.FLAG_DIGEST).pack())
    for retired in (0x2, 0x4):  # the old EAGER and payload-CRC flags
        with pytest.raises(ProtocolError, match="reserved"):
            wire.unpack(Message(MessageType.DATA, tag=7, length=3, total=3, flags=retired).pack())
    with pytest.raises(wire.VersionMismatch, match="version 3, this build speaks 4"):
        wire.unpack(Message(MessageType.HELLO, length=32).pack(version=3))
