"""kvferry's data plane: moves opaque frames (host or CUDA bytes) between sidecars over UCX
(ucxx) or asyncio TCP. Knows nothing of KV caches or codecs.

    listener = await transport.listen("0.0.0.0", 7701, config)
    receive = listener.expect(tag, buffer)          # receiver posts where bytes go
    conn = await pool.get(host, 7701)               # sender
    await conn.send(tag, frame)                     # returns once the receiver has every byte
    nbytes = await receive.wait(timeout)
"""

from .backends import resolve_backend, shutdown_backends
from .config import DEFAULT_UCX_OPTIONS, UCX_PROGRESS_MODES, TransportConfig
from .connection import Connection
from .endpoint import Listener, Pool, connect, listen, peer_host
from .errors import (AuthenticationFailed, ConnectError, CorruptPayload, IncompatiblePeer, PeerLost, ProtocolError, TransferRejected, TransportClosed, TransportError,
                     TransportTimeout)
from .flow import Clearance
from .link import RateLimitedLog
from .mailbox import Mailbox, Receive
from .waiting import until_ready

__all__ = [
    "TransportConfig", "DEFAULT_UCX_OPTIONS", "UCX_PROGRESS_MODES", "listen", "connect", "Listener", "Connection", "Pool",
    "Mailbox", "Receive", "resolve_backend", "shutdown_backends", "TransportError", "ConnectError", "TransportTimeout",
    "PeerLost", "TransportClosed", "ProtocolError", "TransferRejected", "AuthenticationFailed", "CorruptPayload",
    "IncompatiblePeer", "Clearance",
    "until_ready", "RateLimitedLog", "peer_host",
]
