"""The transport's wire messages (version 2): the one place that knows their byte layout.

Every message is a fixed 48-byte little-endian header, followed, for HELLO, AUTH, REJECT, DATA
and MSG only, by ``length`` payload bytes:

    offset size field
         0    4 magic b"KVFT"
         4    1 version (2)
         5    1 type (MessageType)
         6    2 flags (bit 0: DONE on ACK; bit 1: EAGER on RTS; bit 2: PAYLOAD_CRC on DATA and MSG;
                      bit 3: SEGMENTED, with bit 2: the CRC is checksum.py's segmented CRC32C)
         8    8 tag: the transfer this message belongs to
        16    8 offset: DATA: byte offset of the payload in the transfer
        24    8 length: HELLO/AUTH/REJECT/DATA/MSG: payload bytes that follow; ACK: bytes acknowledged
        32    8 total: RTS/CTS/DATA: the transfer's size in bytes
        40    4 payload CRC32C, or with bit 3 its segmented CRC32C (device payloads; with bit 2, else 0)
        44    4 CRC32C of bytes 0..43

A connection starts with the handshake (both ends prove they hold the peer secret; nothing else
is read before it completes):

    connector → HELLO  payload: nonce_c (32 random bytes)
    acceptor  → HELLO  payload: nonce_s (32) + HMAC-SHA256(secret, "kvferry/2 acceptor" + nonce_c + nonce_s)
    connector → AUTH   payload: HMAC-SHA256(secret, "kvferry/2 connector" + nonce_s + nonce_c)
    acceptor  → AUTH   empty: accepted (or REJECT with tag 0 and a reason, then the link closes)

MSG carries a small opaque message of the layer above (the engine's peer protocol), in order with
the connection's other messages.

A transfer: the sender announces it (RTS, tag, total); the receiver, once a buffer is ready,
answers CTS (or REJECT with a UTF-8 reason). An EAGER RTS is for a receive the layer above knows
is posted already: DATA follows at once and no CTS comes (if none is posted: REJECT, and the
DATA is discarded); DATA chunks follow, interleaved with other
transfers' chunks on the same connection; the receiver ACKs bytes as they land (the sender's
window) and sets DONE when the last byte is written. GOODBYE ends a connection cleanly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import google_crc32c

from . import checksum
from .errors import ProtocolError

MAGIC = b"KVFT"
VERSION = 2
FLAG_DONE = 0x1  # on ACK: the last byte is written
FLAG_EAGER = 0x2  # on RTS: DATA follows at once, without waiting for CTS (the receive must be posted)
FLAG_PAYLOAD_CRC = 0x4  # on DATA/MSG: the payload's CRC32C is in the header (checked before the bytes
                        # are used: a mismatch fails that transfer, not the connection)
FLAG_SEGMENTED = 0x8  # with PAYLOAD_CRC: the segmented CRC32C, computed on the GPU (device payloads)
_LAYOUT = struct.Struct("<4sBBHQQQQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _LAYOUT.size + _CRC.size
assert HEADER_SIZE == 48
MAX_REASON_BYTES = 4096
MAX_MESSAGE_BYTES = 16 << 20  # a MSG payload (an announce may list up to 2**20 block ids)
NONCE_BYTES = 32
MAC_BYTES = 32

class MessageType(IntEnum):
    HELLO = 1
    RTS = 2
    CTS = 3
    REJECT = 4
    DATA = 5
    ACK = 6
    GOODBYE = 7
    AUTH = 8
    MSG = 9


@dataclass(frozen=True)
class Message:
    type: MessageType
    tag: int = 0
    offset: int = 0
    length: int = 0
    total: int = 0
    flags: int = 0
    crc: int = 0

    def pack(self) -> bytes:
        body = _LAYOUT.pack(MAGIC, VERSION, int(self.type), self.flags, self.tag, self.offset,
                            self.length, self.total, self.crc)
        return body + _CRC.pack(google_crc32c.value(body))


payload_crc = checksum.crc  # a host payload's CRC32C


def unpack(data: bytes | bytearray | memoryview) -> Message:
    """Parse and check one header.

    Raises:
        ProtocolError: wrong size, magic, version, checksum, type or field combination.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(data)} bytes, expected {HEADER_SIZE}")
    body = bytes(data[:_LAYOUT.size])
    magic, version, kind, flags, tag, offset, length, total, crc = _LAYOUT.unpack(body)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported transport version {version}")
    if _CRC.unpack(bytes(data[_LAYOUT.size:]))[0] != google_crc32c.value(body):
        raise ProtocolError("header checksum mismatch")
    try:
        message_type = MessageType(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind}") from None
    if (flags & ~(FLAG_DONE | FLAG_EAGER | FLAG_PAYLOAD_CRC | FLAG_SEGMENTED)
            or (crc and not flags & FLAG_PAYLOAD_CRC) or (flags & FLAG_SEGMENTED and not flags & FLAG_PAYLOAD_CRC)):
        raise ProtocolError("reserved bits set")
    if flags & FLAG_PAYLOAD_CRC and message_type not in (MessageType.DATA, MessageType.MSG):
        raise ProtocolError(f"payload CRC on {message_type.name}")
    if message_type == MessageType.DATA and offset + length > total:
        raise ProtocolError(f"DATA [{offset}, {offset + length}) beyond transfer size {total}")
    if message_type == MessageType.REJECT and length > MAX_REASON_BYTES:
        raise ProtocolError("REJECT reason too long")
    if message_type == MessageType.MSG and length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"MSG of {length} bytes is over {MAX_MESSAGE_BYTES}")
    if message_type in (MessageType.HELLO, MessageType.AUTH) and length > NONCE_BYTES + MAC_BYTES:
        raise ProtocolError(f"{message_type.name} payload of {length} bytes is too long")
    return Message(message_type, tag, offset, length, total, flags, crc)
