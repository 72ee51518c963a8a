"""The engine's exception tree. The REST front end maps each class to an HTTP status in one place
(``kvferry/api/errors.py``) and the client SDK raises the same classes back, by name.

    EngineError                  anything the engine refuses or fails
    ├── BadRequest               malformed or inconsistent input
    │   ├── InvalidBlocks        block ids out of range, repeated, or of the wrong count
    │   └── UnknownCodec         no codec or codebook of that name fits
    ├── Unauthorized             missing or wrong bearer token
    ├── NotFound                 no such region, transfer or codebook
    ├── Conflict                 name already taken, region busy, transfer already finished
    │   └── RegionMemoryGone     a shm region's segment was truncated under it: its blocks are gone
    ├── PayloadTooLarge          request body above the configured limit
    ├── InsufficientStorage      no memory for an owned region now
    ├── Overloaded               too many concurrent transfers
    ├── PeerError                the peer sidecar refused or failed the transfer, or vanished
    │   ├── ProtocolViolation    the peer sent a message that breaks the peer protocol
    │   └── CorruptChunk         a chunk from the peer failed its codec's checks: nothing of it written
    └── TransferFailed           waiting on a transfer that failed or was cancelled (``reason``)
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises."""


class BadRequest(EngineError):
    pass


class InvalidBlocks(BadRequest):
    pass


class UnknownCodec(BadRequest):
    pass


class Unauthorized(EngineError):
    pass


class NotFound(EngineError):
    pass


class Conflict(EngineError):
    pass


class RegionMemoryGone(Conflict):
    """The region is registered but its memory no longer holds its blocks (a worker truncated
    the shared-memory segment): a conflict between the registration and the memory, which no
    retry mends; delete the region and register it again."""


class PayloadTooLarge(EngineError):
    pass


class InsufficientStorage(EngineError):
    """The memory an owned region needs is not free on its device now (it may be later)."""


class Overloaded(EngineError):
    pass


class PeerError(EngineError):
    pass


class ProtocolViolation(PeerError):
    pass


class CorruptChunk(PeerError):
    """A chunk's frame, authenticated as the peer's, fails its codec's checks (malformed,
    truncated, a checksum): the peer's data is bad, not this sidecar's request."""


class TransferFailed(EngineError):
    """A transfer ended failed or cancelled; ``reason`` says why and ``state`` which."""

    def __init__(self, reason: str, state: str = "failed", kind: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.state = state
        self.kind = kind  # the error class it ended with (``Overloaded``: nothing written, send it again)


BY_NAME: dict[str, type[EngineError]] = {
    cls.__name__: cls for cls in (EngineError, BadRequest, InvalidBlocks, UnknownCodec, Unauthorized, NotFound,
                                  Conflict, RegionMemoryGone, PayloadTooLarge, InsufficientStorage, Overloaded,
                                  PeerError, ProtocolViolation, CorruptChunk, TransferFailed)}
