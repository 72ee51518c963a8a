"""The transport's wire messages (version 4): the one place that knows their byte layout.

Every message is a fixed 48-byte little-endian header, followed, for HELLO, AUTH, REJECT, DATA
and MSG only, by ``length`` payload bytes:

    offset size field
         0    4 magic b"KVFT"
         4    1 version (4; 3 had the EAGER flag on RTS, and a CTS only ever answered an RTS;
                      2 had unkeyed payload CRCs and no session keys)
         5    1 type (MessageType)
         6    2 flags (bit 0: DONE on ACK; bit 3: DIGEST on DATA: the payload tag
                      authenticates the payload's device digest, ``seal.py``)
         8    8 tag: the transfer this message belongs to
        16    8 offset: DATA: byte offset of the payload in the transfer
        24    8 length: HELLO/AUTH/REJECT/DATA/MSG: payload bytes that follow; ACK: bytes acknowledged
        32    8 total: RTS/DATA: the transfer's size in bytes; CTS: the size of the buffer posted
        40    4 reserved (0)
        44    4 CRC32C of bytes 0..43 (accidental damage is named as such, before any key is used)

After the handshake every header is followed by a 32-byte trailer, and the payload (if any)
comes after the trailer:

    48   16 payload tag (GMAC of the payload, of its device digest, or AES-GCM's tag of its
            ciphertext; zero without a payload)
    64   16 header tag (GMAC of the header and the payload tag)

both keyed by the direction's session key and the message's sequence number (``seal.py``).

A connection starts with the handshake (both ends prove they hold the peer secret and agree on
what they speak; nothing else is read before it completes):

    connector → HELLO  nonce_c (32) + offer
    acceptor  → HELLO  nonce_s (32) + offer + HMAC-SHA256(secret, "kvferry/3 acceptor" + transcript)
    connector → AUTH   HMAC-SHA256(secret, "kvferry/3 connector" + transcript)
    acceptor  → AUTH   empty: accepted (or REJECT with tag 0 and a reason, then the link closes;
                       tag 1: the two ends are incompatible, the reason names both)

An offer is u8 security mode (0: authenticated, 1: authenticated and encrypted), u8 n and n
bytes naming the protocol the layer above speaks (e.g. ``kvferry-peer/7``); the transcript is
both HELLO payloads. The session keys come from both nonces, the secret and the transcript.

MSG carries a small opaque message of the layer above (the engine's peer protocol), in order with
the connection's other messages.

A transfer moves on a credit: a CTS that says a buffer of ``total`` bytes is posted for ``tag``.
By rendezvous, the sender asks with RTS (tag, total) and the receiver answers CTS once a buffer is
ready (or REJECT with a UTF-8 reason); by credit, the receiver sends the CTS unasked when it posts
the buffer on this connection, or the layer above agreed on it beforehand (an initial credit: no
CTS at all). No DATA is sent without one: DATA for a tag with no buffer is discarded and
REJECTed. DATA chunks are interleaved with other transfers' chunks on the same connection; the
receiver ACKs bytes as they land (the sender's window) and sets DONE when the last byte is
written. GOODBYE ends a connection cleanly.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import google_crc32c

from .errors import ProtocolError

MAGIC = b"KVFT"
VERSION = 4
FLAG_DONE = 0x1  # on ACK: the last byte is written
FLAG_DIGEST = 0x8  # on DATA: the payload tag covers the payload's device digest (``seal.device_digest``)
_LAYOUT = struct.Struct("<4sBBHQQQQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _LAYOUT.size + _CRC.size
assert HEADER_SIZE == 48
MAX_REASON_BYTES = 4096
TRAILER_BYTES = 32  # after the handshake: payload tag, header tag
SEALED_HEADER_SIZE = HEADER_SIZE + TRAILER_BYTES
MAX_MESSAGE_BYTES = 16 << 20  # a MSG payload (an announce may list up to 2**20 block ids)
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_OFFER_BYTES = 2 + 255
REJECT_INCOMPATIBLE = 1  # a handshake REJECT's tag: the ends speak different versions or modes

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


class Message(NamedTuple):
    """One header's fields (a named tuple: made twice per message, where a frozen dataclass costs
    several times as much)."""

    type: MessageType
    tag: int = 0
    offset: int = 0
    length: int = 0
    total: int = 0
    flags: int = 0

    def pack(self, version: int = VERSION) -> bytes:
        """The header's bytes (``version``: only to answer an older peer in its own layout)."""
        body = _LAYOUT.pack(MAGIC, version, int(self.type), self.flags, self.tag, self.offset,
                            self.length, self.total, 0)
        return body + _CRC.pack(google_crc32c.value(body))


class VersionMismatch(ProtocolError):
    """A well-formed header of another transport version."""

    def __init__(self, version: int):
        super().__init__(f"the peer speaks transport version {version}, this build speaks {VERSION}")
        self.version = version


def unpack(data: bytes | bytearray | memoryview) -> Message:
    """Parse and check one header.

    Raises:
        ProtocolError: wrong size, magic, version, checksum, type or field combination.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(data)} bytes, expected {HEADER_SIZE}")
    body = bytes(data[:_LAYOUT.size])
    magic, version, kind, flags, tag, offset, length, total, reserved = _LAYOUT.unpack(body)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if _CRC.unpack(bytes(data[_LAYOUT.size:]))[0] != google_crc32c.value(body):
        raise ProtocolError("header checksum mismatch")
    if version != VERSION:
        raise VersionMismatch(version)
    message_type = _TYPES.get(kind)
    if message_type is None:
        raise ProtocolError(f"unknown message type {kind}")
    if flags & ~(FLAG_DONE | FLAG_DIGEST) or reserved:
        raise ProtocolError("reserved bits set")
    if flags & FLAG_DIGEST and message_type != MessageType.DATA:
        raise ProtocolError(f"a device digest on {message_type.name}")
    if message_type == MessageType.DATA and offset + length > total:
        raise ProtocolError(f"DATA [{offset}, {offset + length}) beyond transfer size {total}")
    if message_type == MessageType.REJECT and length > MAX_REASON_BYTES:
        raise ProtocolError("REJECT reason too long")
    if message_type == MessageType.MSG and length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"MSG of {length} bytes is over {MAX_MESSAGE_BYTES}")
    if message_type in (MessageType.HELLO, MessageType.AUTH) and length > NONCE_BYTES + MAX_OFFER_BYTES + MAC_BYTES:
        raise ProtocolError(f"{message_type.name} payload of {length} bytes is too long")
    return Message(message_type, tag, offset, length, total, flags)


_TYPES = {int(t): t for t in MessageType}  # a dict look-up: ``MessageType(kind)`` costs a microsecond


def has_payload(message: Message) -> bool:
    """Whether ``length`` payload bytes follow this message's header."""
    return message.type in _WITH_PAYLOAD and message.length > 0


_WITH_PAYLOAD = (MessageType.HELLO, MessageType.AUTH, MessageType.REJECT, MessageType.DATA, MessageType.MSG)
