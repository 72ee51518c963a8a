"""The peer protocol between sidecars (version 8): the one place that knows its byte layout.

Peer messages ride as MSG payloads on the authenticated transport connection (``transport/wire.py``),
in order with the chunks they describe; sidecars never call each other over HTTP. All integers are
little-endian. Every message starts with a 24-byte header:

    offset size field
         0    4 magic b"KVFP"
         4    1 version (8; 7 named a shared-memory target without its segment's identity, 6 had
                    no WRITING announce, 5 granted every chunk unasked, 4 had
                    no tapered chunk plans, 3 no spread block lists, 2 no standing leases, 1 no
                    reference regions)
         5    1 type (Kind)
         6    2 reserved (0)
         8   16 transfer id (the 16 bytes of its 32-hex-digit id; all 0 for REVOKE and REVOKED,
                    which concern the connection)

then a body by type, built from: u8/u16/u32/u64; ``str8``/``str16`` (u8 or u16 byte length, UTF-8);
``blocks`` (u8 form; form 0 = ids: u32 n, n × u32; form 1 = ranges: u32 n, n × (u32 start,
u32 count, i32 stride); form 2 = spread ids: u32 n, n × u32, u32 count, i32 stride: each id b
stands for b, b + stride, ..., count of them).

    ANNOUNCE  str8 codec, str8 dtype, str8 codebook ("" = none), 8 bytes codebook digest,
              blocks dst_blocks, u16 pairs, per pair: str8 dst region, u8 ndim, ndim × u32
              block shape, u32 blocks per chunk (a chunk holds at most 1 GiB of raw KV, or one block),
              str8 reference region ("" = none: the receiver's
              region of predictor KV for the same blocks); then u32 inline chunks, 16 bytes host id
              (all 0: no same-host write offered), u8 flags (bit 0 WRITTEN: the sender already wrote
              every block into memory this connection holds a standing lease on; bit 1 TAPERED: the
              chunk plan's first and last chunks are split, ``plan_chunks``; bit 2 WRITING: the
              sender is writing every block into such memory now, and its write ends when the CUDA
              event that follows is reached; at most one of WRITTEN and WRITING); with WRITING only:
              64 bytes CUDA IPC event handle, 16 bytes UUID of the GPU the event belongs to
    CHUNK     u32 chunk index, then the chunk's frame (the rest of the message)
    ACCEPT    u16 targets (0, or one per pair: the receiver takes the same-host write offer), per
              target: 64 bytes handle (CUDA IPC handle; for host shared memory its name, NUL-padded),
              u64 offset, 16 bytes GPU UUID (all 0: host shared memory), u32 region blocks, 16 bytes
              segment (host shared memory: u64 device and u64 inode of the segment the receiver maps,
              which the sender checks it opened by the name; all 0 for GPU memory)
    WRITTEN   u32 blocks: the sender wrote every block into the targets (its GPU work finished)
    REJECT    str8 error class, str16 reason     the receiver refused the announce; nothing written
    DONE      u32 blocks written, u64 raw bytes, u64 wire bytes   every block is written
    CANCEL    str16 reason                       either side gives the transfer up
    ERROR     str8 error class, str16 reason     the receiver failed mid-transfer
    REVOKE    str8 region                        receiver to sender: stop writing this region
    REVOKED   str8 region                        sender: no write of mine into it is under way or to come

A transfer's chunks are transport transfers whose tags ``chunk_tag(id, index)`` derive from it;
the chunk plan follows from the announce (``plan_chunks``), so it is not sent. Every chunk moves
on a credit, a buffer the receiver posted for it: no byte arrives without one. The first ``inline
chunks`` chunks are small and ride as CHUNK messages right behind the announce (their credit is
the announce itself: one write, no transport handshake, what makes a one-block transfer one round
trip). A receiver that admits an announce grants the next ``EAGER_CHUNKS`` chunks buffers on the
announce's connection before it reads another message (the initial credit: the sender streams
them at once), and grants each later chunk by a transport CTS sent unasked, at most
``CREDIT_WINDOW`` chunks past the last one it took; the sender waits for those. ACCEPT is sent
only for transfers with transport chunks or a same-host offer: a transfer whose chunks all ride
inline is answered by its DONE alone; memory lent in an ACCEPT is a credit for the whole transfer.

Targets lent in an ACCEPT are a *standing lease* for the connection (NIXL's model: memory
registered once): the sender may write later transfers into them at once and send their
ANNOUNCE with the WRITTEN flag behind the data, one message, answered by DONE. A large write on
a GPU is announced as soon as it is launched, flagged WRITING with an interprocess event recorded
behind it: the receiver admits the transfer while the copy runs and says DONE once the event is
reached (the event opened on the GPU the write lands on), so the announce's round trip overlaps
the copy. A receiver that cannot open the event answers with an empty ACCEPT, and the sender then sends
WRITTEN once its write has finished. A receiver lets a
region go only after REVOKE has been answered by REVOKED (or the connection is gone).
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .blocks import Blocks, Range, RangeTable, _columns
from .errors import ProtocolViolation
from .plan import TAPER, ChunkTags, Plan, chunk_count, chunk_tag, plan_chunks  # noqa: F401  (the protocol's chunking)

MAGIC = b"KVFP"
VERSION = 8  # 7: a shared-memory target without its segment's identity
_HEADER = struct.Struct("<4sBBH16s")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 24
MAX_PAIRS = 1024  # region pairs per transfer (a model's layers, K and V apart: far fewer)
EAGER_CHUNKS = 2
CREDIT_WINDOW = 64  # a receiver grants no chunk further than this past the last one it took
INLINE_CHUNK_BYTES = 256 << 10  # a chunk frame at most this big may ride inline (host memory only)
INLINE_TOTAL_BYTES = 4 << 20  # and all inline chunks of a transfer together
MAX_IDS = 1 << 20
MAX_CHUNKS = 1 << 20  # chunks per transfer (all pairs)
MAX_INLINE_CHUNKS = 1024  # chunks riding inline behind an announce (they are small: INLINE_TOTAL_BYTES)
MAX_CHUNK_BYTES = 1 << 30  # raw KV per chunk (more only where one block is larger): a receiver's buffer for it


class Kind(IntEnum):
    ANNOUNCE = 1
    ACCEPT = 2
    REJECT = 3
    DONE = 4
    CANCEL = 5
    ERROR = 6
    CHUNK = 7
    WRITTEN = 8
    REVOKE = 9
    REVOKED = 10


LINK_ID = "0" * 32  # the transfer id of messages about the connection, not a transfer
FLAG_WRITTEN = 1  # ANNOUNCE: every block is already written under a standing lease
FLAG_TAPERED = 2  # ANNOUNCE: the chunk plan is tapered (``plan_chunks``)
FLAG_WRITING = 4  # ANNOUNCE: every block is being written under a standing lease; ends at ``event``
EVENT_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
HOST_MEMORY = bytes(16)  # a Target's device UUID for host shared memory


@dataclass(frozen=True)
class PairLayout:
    """One destination region of an announced transfer, with what the sender will put in it."""

    dst_region: str
    block_shape: tuple[int, ...]
    blocks_per_chunk: int
    reference: str = ""  # the receiver's region of predictor KV for these blocks ("" = none)


@dataclass(frozen=True)
class Announce:
    codec: str
    dtype: str
    dst_blocks: Blocks
    pairs: tuple[PairLayout, ...]
    codebook: str = ""
    codebook_digest: bytes = bytes(8)
    inline_chunks: int = 0
    host: bytes = bytes(16)
    flags: int = 0
    event: bytes = b""  # WRITING: the CUDA IPC handle of the event that ends the sender's write
    event_gpu: bytes = b""  # WRITING: the UUID of the GPU that event belongs to


@dataclass(frozen=True)
class Target:
    """A destination region lent for a same-host write (``ipc.py``)."""

    handle: bytes
    offset: int
    device_uuid: bytes
    num_blocks: int
    segment: bytes = bytes(16)  # host shared memory: ``segment_id`` of what the receiver maps (a name can be reused)


def segment_id(stat: os.stat_result) -> bytes:
    """A shared-memory segment's identity in a ``Target``: its file's device and inode."""
    return struct.pack("<QQ", stat.st_dev, stat.st_ino)


@dataclass(frozen=True)
class Written:
    blocks: int


@dataclass(frozen=True)
class Chunk:
    index: int
    frame: bytes | memoryview  # parsed: a view into the message's own buffer (no copy)


@dataclass(frozen=True)
class Reject:
    error: str
    reason: str


@dataclass(frozen=True)
class Done:
    blocks: int
    bytes_raw: int
    bytes_wire: int


@dataclass(frozen=True)
class Cancel:
    reason: str


@dataclass(frozen=True)
class Error:
    error: str
    reason: str


@dataclass(frozen=True)
class Accept:
    targets: tuple[Target, ...] = ()


@dataclass(frozen=True)
class Revoke:
    region: str


@dataclass(frozen=True)
class Revoked:
    region: str


Body = Announce | Accept | Reject | Done | Cancel | Error | Chunk | Written | Revoke | Revoked
_KIND = {Announce: Kind.ANNOUNCE, Accept: Kind.ACCEPT, Reject: Kind.REJECT, Done: Kind.DONE,
         Cancel: Kind.CANCEL, Error: Kind.ERROR, Chunk: Kind.CHUNK, Written: Kind.WRITTEN,
         Revoke: Kind.REVOKE, Revoked: Kind.REVOKED}
HANDLE_BYTES = 64
_KIND_BY_VALUE = {int(k): k for k in Kind}  # a dict look-up: ``Kind(kind)`` costs a microsecond


@dataclass(frozen=True)
class Message:
    transfer_id: str
    body: Body = field(default_factory=Accept)

    @property
    def kind(self) -> Kind:
        return _KIND[type(self.body)]


def inline_prefix(sizes: Iterable[int]) -> int:
    """How many leading chunks, of these worst-case frame sizes, may ride inline behind their
    announce: each at most ``INLINE_CHUNK_BYTES``, together at most ``INLINE_TOTAL_BYTES``. The
    sender plans by it and the receiver holds announces to it (it decodes them on its loop)."""
    count = total = 0
    for size in sizes:
        total += size
        if size > INLINE_CHUNK_BYTES or total > INLINE_TOTAL_BYTES:
            break
        count += 1
    return count


def codebook_digest(codebook_json: str) -> bytes:
    return hashlib.blake2b(codebook_json.encode(), digest_size=8).digest()


# ---- packing -----------------------------------------------------------------------------------
def pack(message: Message) -> bytes:
    """Bytes of ``message``.

    Raises:
        ProtocolViolation: a field does not fit its layout (name too long, too many ids, ...).
    """
    try:
        out = [_HEADER.pack(MAGIC, VERSION, int(message.kind), 0, bytes.fromhex(message.transfer_id))]
    except ValueError as exc:
        raise ProtocolViolation(f"transfer id {message.transfer_id!r} is not 32 hex digits") from exc
    if len(out[0]) != HEADER_SIZE or len(message.transfer_id) != 32:
        raise ProtocolViolation(f"transfer id {message.transfer_id!r} is not 32 hex digits")
    body = message.body
    try:
        if isinstance(body, Announce):
            head, tail = _announce_around(body.codec, body.dtype, body.codebook, bytes(body.codebook_digest),
                                          body.pairs, body.inline_chunks, bytes(body.host), body.flags)
            out += [head, _blocks(body.dst_blocks), tail]
            if body.flags & FLAG_WRITING:
                if len(body.event) != EVENT_BYTES or len(body.event_gpu) != 16:
                    raise ProtocolViolation("a WRITING announce carries a 64-byte event handle and a 16-byte GPU UUID")
                out += [bytes(body.event), bytes(body.event_gpu)]
            elif body.event or body.event_gpu:
                raise ProtocolViolation("only a WRITING announce carries an event")
        elif isinstance(body, Accept):
            out.append(struct.pack("<H", len(body.targets)))
            for target in body.targets:
                if len(target.handle) != HANDLE_BYTES or len(target.device_uuid) != 16 or len(target.segment) != 16:
                    raise ProtocolViolation("bad IPC target")
                out += [target.handle, struct.pack("<Q", target.offset), target.device_uuid,
                        struct.pack("<I", target.num_blocks), target.segment]
        elif isinstance(body, Written):
            out.append(struct.pack("<I", body.blocks))
        elif isinstance(body, Chunk):
            out += [struct.pack("<I", body.index), body.frame]
        elif isinstance(body, (Reject, Error)):
            out += [_str(body.error, 1), _str(body.reason, 2)]
        elif isinstance(body, Done):
            out.append(struct.pack("<IQQ", body.blocks, body.bytes_raw, body.bytes_wire))
        elif isinstance(body, Cancel):
            out.append(_str(body.reason, 2))
        elif isinstance(body, (Revoke, Revoked)):
            out.append(_str(body.region, 1))
    except struct.error as exc:
        raise ProtocolViolation(f"{message.kind.name} field out of range: {exc}") from exc
    return b"".join(out)


@functools.lru_cache(maxsize=256)
def _announce_around(codec: str, dtype: str, codebook: str, digest: bytes, pairs: tuple[PairLayout, ...],
                     inline: int, host: bytes, flags: int) -> tuple[bytes, bytes]:
    """An announce's bytes before and after its block list, packed once for each distinct set of
    its other fields: a sender repeats them for every transfer between the same regions.

    Raises:
        ProtocolViolation, struct.error: as ``pack`` (a failed pack is not kept).
    """
    if len(digest) != 8 or not 0 < len(pairs) <= MAX_PAIRS:
        raise ProtocolViolation("bad announce")
    if len(host) != 16:
        raise ProtocolViolation("a host id is 16 bytes")
    tail = [struct.pack("<H", len(pairs))]
    for pair in pairs:
        tail += [_str(pair.dst_region, 1), struct.pack(f"<B{len(pair.block_shape)}I", len(pair.block_shape),
                                                       *pair.block_shape),
                 struct.pack("<I", pair.blocks_per_chunk), _str(pair.reference, 1)]
    tail += [struct.pack("<I", inline), host, struct.pack("<B", flags)]
    return _str(codec, 1) + _str(dtype, 1) + _str(codebook, 1) + digest, b"".join(tail)


def _str(text: str, width: int) -> bytes:
    raw = text.encode()
    limit = (1 << (8 * width)) - 1
    if len(raw) > limit:
        raw = raw[:limit]  # reasons are cut; names never get here (validated far shorter)
    return len(raw).to_bytes(width, "little") + raw


def _blocks(blocks: Blocks) -> bytes:
    if blocks.ranges is not None:
        starts, counts, strides = _columns(blocks.ranges)
        if len(starts) and (min(starts.min(), counts.min()) < 0 or max(starts.max(), counts.max()) >> 32
                            or not -(1 << 31) <= strides.min() <= strides.max() < 1 << 31):
            raise struct.error("a block range outside the wire's fields (u32 start and count, i32 stride)")
        table = np.empty(len(starts), dtype=_RANGE_COLUMNS)
        table["start"], table["count"], table["stride"] = starts, counts, strides
        return struct.pack("<BI", 1, len(blocks.ranges)) + table.tobytes()
    if len(blocks.ids) > MAX_IDS:
        raise ProtocolViolation(f"{len(blocks.ids)} block ids is over {MAX_IDS}")
    ids = struct.pack(f"<BI{len(blocks.ids)}I", 0 if blocks.spread is None else 2, len(blocks.ids), *blocks.ids)
    return ids if blocks.spread is None else ids + struct.pack("<Ii", *blocks.spread)


# ---- parsing -----------------------------------------------------------------------------------
_RANGE = struct.Struct("<IIi")
_RANGE_COLUMNS = np.dtype([("start", "<u4"), ("count", "<u4"), ("stride", "<i4")])  # the same, as columns


@functools.lru_cache(maxsize=256)
def _layout(fmt: str) -> struct.Struct:
    return struct.Struct("<" + fmt)


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ProtocolViolation("peer message is truncated")
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return chunk

    def unpack(self, fmt: str) -> tuple:
        layout = _layout(fmt)
        if self.at + layout.size > len(self.data):
            raise ProtocolViolation("peer message is truncated")
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def text(self, width: int) -> str:
        (n,) = self.unpack("B" if width == 1 else "H")
        try:
            return self.take(n).decode()
        except UnicodeDecodeError as exc:
            raise ProtocolViolation("peer message holds invalid UTF-8") from exc

    def blocks(self) -> Blocks:
        form, n = self.unpack("BI")
        if n > MAX_IDS:
            raise ProtocolViolation(f"block list of {n} entries")
        if form == 0:
            return Blocks(ids=self.unpack(f"{n}I"))
        if form == 1:
            table = np.frombuffer(self.take(n * _RANGE.size), dtype=_RANGE_COLUMNS)
            ranges = RangeTable(table["start"], table["count"], table["stride"])
            if ranges.total > MAX_IDS:
                raise ProtocolViolation(f"ranges of over {MAX_IDS} blocks")
            return Blocks(ranges=ranges)
        if form == 2:
            ids, (count, stride) = self.unpack(f"{n}I"), self.unpack("Ii")
            if count == 0 or stride == 0:
                raise ProtocolViolation(f"a spread of {count} ids {stride} apart")
            if n * count > MAX_IDS:
                raise ProtocolViolation(f"a spread of over {MAX_IDS} blocks")
            return Blocks(ids=ids, spread=(count, stride))
        raise ProtocolViolation(f"unknown block list form {form}")


def unpack(data: bytes | bytearray) -> Message:
    """Parse one peer message.

    Raises:
        ProtocolViolation: wrong magic, version, kind, a truncated or overlong body.
    """
    if len(data) < HEADER_SIZE:
        raise ProtocolViolation(f"peer message of {len(data)} bytes is shorter than its header")
    magic, version, kind, reserved, raw_id = _HEADER.unpack(data[:HEADER_SIZE])
    if magic != MAGIC:
        raise ProtocolViolation(f"bad peer-message magic {magic!r}")
    if version != VERSION:
        raise ProtocolViolation(f"unsupported peer protocol version {version} (this build speaks {VERSION})")
    if reserved:
        raise ProtocolViolation("reserved bits set")
    known = _KIND_BY_VALUE.get(kind)
    if known is None:
        raise ProtocolViolation(f"unknown peer message kind {kind}")
    kind = known
    if kind != Kind.CHUNK:
        data = bytes(data)  # fields taken from it are bytes (hashable), whatever buffer it came in
    r = _Reader(data)
    r.at = HEADER_SIZE
    body: Body
    if kind == Kind.ANNOUNCE:
        codec, dtype, codebook = r.text(1), r.text(1), r.text(1)
        digest = r.take(8)
        dst_blocks = r.blocks()
        pairs, inline, host, flags, event, event_gpu = _announce_tail(data[r.at:])
        r.at = len(data)
        body = Announce(codec, dtype, dst_blocks, pairs, codebook, digest, inline, host, flags, event, event_gpu)
    elif kind == Kind.CHUNK:
        (index,) = r.unpack("I")
        body = Chunk(index, memoryview(data)[r.at:])
        r.at = len(data)
    elif kind == Kind.ACCEPT:
        (count,) = r.unpack("H")
        if count > MAX_PAIRS:
            raise ProtocolViolation(f"accept of {count} targets")
        body = Accept(tuple(Target(r.take(HANDLE_BYTES), r.unpack("Q")[0], r.take(16), r.unpack("I")[0], r.take(16))
                            for _ in range(count)))
    elif kind == Kind.WRITTEN:
        body = Written(*r.unpack("I"))
    elif kind == Kind.REJECT:
        body = Reject(r.text(1), r.text(2))
    elif kind == Kind.ERROR:
        body = Error(r.text(1), r.text(2))
    elif kind == Kind.DONE:
        body = Done(*r.unpack("IQQ"))
    elif kind == Kind.REVOKE:
        body = Revoke(r.text(1))
    elif kind == Kind.REVOKED:
        body = Revoked(r.text(1))
    else:
        body = Cancel(r.text(2))
    if r.at != len(data):
        raise ProtocolViolation(f"{len(data) - r.at} bytes after a {kind.name} message")
    return Message(raw_id.hex(), body)


# Tails up to this long are parsed once and kept (a few pairs: the hot path); a longer one is
# parsed each time, so that a peer cannot make the cache hold megabytes of its messages.
CACHED_TAIL_BYTES = 1024


def _announce_tail(data: bytes) -> tuple[tuple[PairLayout, ...], int, bytes, int, bytes, bytes]:
    """An announce after its block list (its pairs, inline chunks, host, flags, event).

    Raises:
        ProtocolViolation: as ``unpack``.
    """
    return _short_tail(data) if len(data) <= CACHED_TAIL_BYTES else _parse_tail(data)


@functools.lru_cache(maxsize=256)
def _short_tail(data: bytes) -> tuple[tuple[PairLayout, ...], int, bytes, int, bytes, bytes]:
    """``_parse_tail``, once for each distinct short tail: a sender repeats it for every transfer
    between the same regions (a failed parse is not kept)."""
    return _parse_tail(data)


def _parse_tail(data: bytes) -> tuple[tuple[PairLayout, ...], int, bytes, int, bytes, bytes]:
    r = _Reader(data)
    (count,) = r.unpack("H")
    if not 0 < count <= MAX_PAIRS:
        raise ProtocolViolation(f"announce of {count} region pairs")
    pairs = []
    for _ in range(count):
        name = r.text(1)
        (ndim,) = r.unpack("B")
        shape = r.unpack(f"{ndim}I")
        (per_chunk,) = r.unpack("I")
        if per_chunk == 0:
            raise ProtocolViolation("zero blocks per chunk")
        pairs.append(PairLayout(name, tuple(shape), per_chunk, r.text(1)))
    (inline,) = r.unpack("I")
    host = r.take(16)
    (flags,) = r.unpack("B")
    if flags & ~(FLAG_WRITTEN | FLAG_TAPERED | FLAG_WRITING):
        raise ProtocolViolation(f"unknown announce flags {flags:#x}")
    if flags & FLAG_WRITTEN and flags & FLAG_WRITING:
        raise ProtocolViolation("an announce flagged both WRITTEN and WRITING")
    event, event_gpu = (r.take(EVENT_BYTES), r.take(16)) if flags & FLAG_WRITING else (b"", b"")
    if r.at != len(data):
        raise ProtocolViolation(f"{len(data) - r.at} bytes after an ANNOUNCE message")
    return tuple(pairs), inline, host, flags, event, event_gpu
