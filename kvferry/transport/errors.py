"""The transport's exception tree. Backend errors (OSError, ucxx's UCXError) are translated at
the backend's edge and chained with ``from``.

    TransportError
    ├── ConnectError       could not reach the peer (refused, unreachable, connect timeout)
    ├── TransportTimeout   an operation made no progress within its timeout (also TimeoutError)
    ├── PeerLost           the peer vanished or reset the connection mid-operation
    ├── TransportClosed    the connection or listener was closed locally
    ├── ProtocolError      the peer sent bytes that are not a valid kvferry transport message
    ├── TransferRejected   the receiver refused a transfer (no such tag, buffer too small, ...)
    ├── AuthenticationFailed  the peer does not hold the shared peer secret (handshake refused),
    │                         or a message after the handshake failed its authentication tag
    ├── IncompatiblePeer   the two ends speak different versions or security modes (at connect)
    └── CorruptPayload     a payload failed its authentication tag (nothing was handed on, or a
                           deferred check failed); the connection is closed
"""


class TransportError(Exception):
    """Root of every error the transport raises."""


class ConnectError(TransportError):
    """The peer could not be reached."""


class TransportTimeout(TransportError, TimeoutError):
    """An operation made no progress within its timeout."""


class PeerLost(TransportError):
    """The peer vanished, reset or closed the connection while an operation was pending."""


class TransportClosed(TransportError):
    """The connection or listener was closed locally."""


class ProtocolError(TransportError):
    """The peer sent a malformed or unexpected message; the connection is dropped."""


class TransferRejected(TransportError):
    """The receiving side refused the transfer; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AuthenticationFailed(TransportError):
    """The handshake failed: one side does not hold the shared peer secret."""


class IncompatiblePeer(TransportError):
    """The peer speaks another transport or peer-protocol version, or another security mode."""


class LinkAbsorbed(TransportError):
    """A new socket was a lane of another link (``lanes``): it lives on there, quietly."""


class CorruptPayload(TransportError):
    """A payload's bytes do not match their authentication tag; they were not handed on."""
