"""The control lane (version 1): the one place that knows its byte layout.

An engine submits a transfer and waits for its end once per request, and over HTTP each call paid
~0.3–0.7 ms of request and response handling in both processes (``bench/RESULTS.md``), more than a
transfer of one block. The lane carries the same two calls — ``POST /v1/transfers`` and ``GET
/v1/transfers/{id}``, with the same JSON bodies, records, statuses and error bodies — as
length-prefixed binary frames on a kept-open TCP connection to the sidecar's lane port. Every other
call stays on the REST API. The lane listens where the API does, under the same token.

All integers are little-endian. A frame is a u32 size (of what follows, at most ``MAX_FRAME``),
then a 12-byte header and a body by kind:

    offset size field
         0    4 magic b"KVFL"
         4    1 version (1)
         5    1 kind (Kind)
         6    2 reserved (0)
         8    4 tag: the client's, echoed in the reply to that frame

    HELLO    (client, first frame) str16 token: the API's bearer token ("" for a sidecar without one)
    WELCOME  (sidecar) nothing: the token is good; requests may follow
    REQUEST  (client) u8 method (1 GET, 2 POST), str16 target (path and query, as in HTTP), then the
             JSON body to the end (empty for GET)
    REPLY    (sidecar) u16 status, then the JSON body to the end: what the REST API answers to the
             same request (``ErrorBody`` for an error)

One request is in flight per connection (a client opens one per concurrent call, as HTTP/1.1
keep-alive does). A sidecar answers a frame it cannot parse, a wrong token or an oversized frame
with a REPLY (400, 401, 413) and closes the connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from .errors import PayloadTooLarge, ProtocolViolation

MAGIC = b"KVFL"
VERSION = 1
_SIZE = struct.Struct("<I")
_HEADER = struct.Struct("<4sBBHI")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 12
MAX_FRAME = 64 << 20  # no larger than the API's request body limit (max_body_bytes' default)
METHODS = {1: "GET", 2: "POST"}
_METHOD_CODES = {name: code for code, name in METHODS.items()}


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    REQUEST = 3
    REPLY = 4


@dataclass(frozen=True)
class Hello:
    token: str


@dataclass(frozen=True)
class Welcome:
    pass


@dataclass(frozen=True)
class Request:
    method: str  # GET or POST
    target: str  # path and query, e.g. /v1/transfers?wait=10
    body: bytes = b""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes = b""


Body = Hello | Welcome | Request | Reply
_KIND = {Hello: Kind.HELLO, Welcome: Kind.WELCOME, Request: Kind.REQUEST, Reply: Kind.REPLY}


def pack(tag: int, body: Body) -> bytes:
    """One whole frame, its size prefix included.

    Raises:
        ProtocolViolation: a field does not fit (an unknown method, a target or token over 64 KiB).
        PayloadTooLarge: a frame over ``MAX_FRAME``.
    """
    try:
        head = _HEADER.pack(MAGIC, VERSION, int(_KIND[type(body)]), 0, tag)
        if isinstance(body, Hello):
            rest = _str16(body.token)
        elif isinstance(body, Request):
            if body.method not in _METHOD_CODES:
                raise ProtocolViolation(f"the lane carries GET and POST, not {body.method}")
            rest = struct.pack("<B", _METHOD_CODES[body.method]) + _str16(body.target) + body.body
        elif isinstance(body, Reply):
            rest = struct.pack("<H", body.status) + body.body
        else:
            rest = b""
    except struct.error as exc:
        raise ProtocolViolation(f"lane frame field out of range: {exc}") from exc
    size = HEADER_SIZE + len(rest)
    if size > MAX_FRAME:
        raise PayloadTooLarge(f"a lane frame of {size} bytes is over {MAX_FRAME}")
    return _SIZE.pack(size) + head + rest


def frame_size(prefix: bytes, limit: int = MAX_FRAME) -> int:
    """The size a frame's 4-byte prefix announces.

    Raises:
        ProtocolViolation: shorter than a header. PayloadTooLarge: over ``limit``.
    """
    (size,) = _SIZE.unpack(prefix)
    if size < HEADER_SIZE:
        raise ProtocolViolation(f"a lane frame of {size} bytes is shorter than its header")
    if size > limit:
        raise PayloadTooLarge(f"a lane frame of {size} bytes is over {limit}")
    return size


def unpack(frame: bytes) -> tuple[int, Body]:
    """(tag, body) of one frame, without its size prefix.

    Raises:
        ProtocolViolation: wrong magic, version or kind, a truncated body, invalid UTF-8.
    """
    if len(frame) < HEADER_SIZE:
        raise ProtocolViolation(f"a lane frame of {len(frame)} bytes is shorter than its header")
    magic, version, kind, reserved, tag = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolViolation(f"bad lane magic {magic!r}")
    if version != VERSION:
        raise ProtocolViolation(f"lane version {version}; this sidecar speaks {VERSION}")
    if reserved:
        raise ProtocolViolation("reserved lane header bits set")
    rest = memoryview(frame)[HEADER_SIZE:]
    if kind == Kind.HELLO:
        token, end = _text(rest, 0)
        if end != len(rest):
            raise ProtocolViolation("bytes after a HELLO's token")
        return tag, Hello(token)
    if kind == Kind.WELCOME:
        if len(rest):
            raise ProtocolViolation("a WELCOME has no body")
        return tag, Welcome()
    if kind == Kind.REQUEST:
        if len(rest) < 1 or rest[0] not in METHODS:
            raise ProtocolViolation("a REQUEST without a known method")
        target, end = _text(rest, 1)
        return tag, Request(METHODS[rest[0]], target, bytes(rest[end:]))
    if kind == Kind.REPLY:
        if len(rest) < 2:
            raise ProtocolViolation("a REPLY without a status")
        return tag, Reply(struct.unpack_from("<H", rest)[0], bytes(rest[2:]))
    raise ProtocolViolation(f"unknown lane frame kind {kind}")


def _str16(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise ProtocolViolation(f"a lane string of {len(raw)} bytes is over 65535")
    return struct.pack("<H", len(raw)) + raw


def _text(view: memoryview, at: int) -> tuple[str, int]:
    if len(view) < at + 2:
        raise ProtocolViolation("a lane frame cut off in a string's length")
    (n,) = struct.unpack_from("<H", view, at)
    end = at + 2 + n
    if end > len(view):
        raise ProtocolViolation("a lane frame cut off in a string")
    try:
        return bytes(view[at + 2:end]).decode(), end
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("a lane string is not UTF-8") from exc
