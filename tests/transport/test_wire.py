"""Golden bytes and validation of the transport's message header."""

from __future__ import annotations

import pytest

from kvferry.transport import ProtocolError, wire
from kvferry.transport.wire import Message, MessageType

GOLDEN = bytes.fromhex(
    "4b56465402050100" "0700000000000000" "0010000000000000" "0004000000000000"
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
        "4b56465402090000" "0000000000000000" "0000000000000000" "0500000000000000")
    assert Message(MessageType.AUTH).pack()[:8].hex() == "4b56465402080000"
    assert Message(MessageType.HELLO, length=32).pack()[24:32] == (32).to_bytes(8, "little")


def test_oversized_msg_and_handshake_payloads_are_rejected():
    with pytest.raises(ProtocolError, match="MSG"):
        wire.unpack(Message(MessageType.MSG, length=wire.MAX_MESSAGE_BYTES + 1).pack())
    with pytest.raises(ProtocolError, match="HELLO"):
        wire.unpack(Message(MessageType.HELLO, length=65).pack())


def test_handshake_macs_are_hmac_sha256_golden():
    from kvferry.transport import handshake

    got = handshake.mac(b"secret", b"kvferry/2 acceptor", bytes(32), bytes(range(32)))
    assert got.hex() == __import__("hmac").new(b"secret", b"kvferry/2 acceptor" + bytes(32) + bytes(range(32)),
                                               "sha256").hexdigest()


def test_golden_payload_crc_and_its_rules():
    message = Message(MessageType.DATA, tag=7, offset=0, length=3, total=3, flags=wire.FLAG_PAYLOAD_CRC,
                      crc=wire.payload_crc(b"abc"))
    packed = message.pack()
    assert packed[6:8] == (4).to_bytes(2, "little") and packed[40:44] == (0x364B3FB7).to_bytes(4, "little")
    assert wire.unpack(packed) == message
    with pytest.raises(ProtocolError, match="reserved"):  # a CRC without its flag
        wire.unpack(Message(MessageType.DATA, tag=7, length=3, total=3, crc=5).pack())
    with pytest.raises(ProtocolError, match="payload CRC"):
        wire.unpack(Message(MessageType.ACK, tag=7, flags=wire.FLAG_PAYLOAD_CRC, crc=5).pack())
