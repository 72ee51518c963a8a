"""Transport settings, built once by the caller (the daemon's settings) and passed down frozen.
The transport never reads the environment itself; UCX's own ``UCX_*`` variables still reach UCX
(``transport/ucx.py`` only gives ``UCX_MEMTYPE_CACHE`` a default before UCX loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

MiB = 1 << 20

# UCX options applied unless the caller overrides them (keys without the UCX_ prefix). Large
# TCP segments matter most on hosts without RDMA; REUSEADDR lets a listener restart on its port.
DEFAULT_UCX_OPTIONS: Mapping[str, str] = MappingProxyType({
    "TCP_TX_SEG_SIZE": "1m",
    "TCP_RX_SEG_SIZE": "1m",
    "TCP_CM_REUSEADDR": "y",
})

UCX_PROGRESS_MODES = ("blocking", "thread", "polling", "thread-polling")  # ucxx's own names


@dataclass(frozen=True)
class TransportConfig:
    """How frames move between sidecars.

    ``backend`` is ``"auto"`` (ucxx where it imports and an RDMA device opens, else TCP), ``"ucxx"`` or ``"tcp"``.
    Frames larger than ``chunk_bytes`` travel as several messages; at most
    ``max_inflight_bytes`` are sent and not yet acknowledged per connection (backpressure).
    """

    backend: str = "auto"
    # 16 MiB messages: per-message cost (two UCX requests, Python) stays small next to the copy.
    chunk_bytes: int = 16 * MiB
    max_inflight_bytes: int = 128 * MiB
    connect_timeout: float = 5.0
    op_timeout: float = 30.0
    # The slowest a peer may move bytes: one message of N bytes may take N / this longer than
    # op_timeout to write (or, given to ``Receive.wait``, to come in whole). 0: no allowance.
    min_bytes_per_s: float = 0.0
    close_timeout: float = 5.0
    # Link emulation for benchmarks: pace DATA to this many bytes/s per connection (0 = off).
    pace_bytes_per_s: float = 0.0
    # A listener's limits: authenticated connections at once (more are closed at once), and how
    # long an accepted connection with nothing in flight may stay silent.
    max_connections: int = 256
    # Connections still in the handshake (unauthenticated), apart from those: at once, and at
    # once from one address (``endpoint.Listener`` says how a full budget is shared).
    max_handshaking_connections: int = 64
    max_handshaking_per_source: int = 16
    idle_timeout: float = 300.0
    # The shared peer secret both ends of a connection must prove they hold (HMAC handshake).
    secret: bytes = field(default=b"", repr=False)
    # What the layer above speaks (agreed in the handshake: a mismatch fails at connect), and
    # whether payloads are encrypted as well as authenticated (both ends must agree).
    protocol: str = ""
    encrypt: bool = False
    # TCP connections per link a dialler opens: large DATA payloads spread over them (one TCP
    # stream moves what one core copies; a fast NIC needs several). 1: a plain stream.
    tcp_lanes: int = 1
    # A peer whose address is this network namespace's own is dialled over the Unix socket its
    # listener also accepts on (the tcp backend's; a listener with it off accepts on TCP only).
    local_socket: bool = False
    ucx_options: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_UCX_OPTIONS))
    # How ucxx progresses its worker (one choice per process, at its first listen/connect).
    # "blocking": on the event loop, woken by the worker's event fd; ucxx's default "thread"
    # hands each completion from its progress thread through a notifier thread to the loop,
    # which cost ~0.4 ms per message on an H200 host (docs/decisions/008-ucxx-progress-on-the-event-loop.md).
    ucx_progress_mode: str = "blocking"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "ucxx", "tcp"):
            raise ValueError(f"backend must be auto, ucxx or tcp, not {self.backend!r}")
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise ValueError(f"ucx_progress_mode must be one of {', '.join(UCX_PROGRESS_MODES)}, "
                             f"not {self.ucx_progress_mode!r}")
        if self.chunk_bytes <= 0 or self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError("need 0 < chunk_bytes <= max_inflight_bytes")
        if min(self.connect_timeout, self.op_timeout, self.close_timeout, self.idle_timeout) <= 0:
            raise ValueError("timeouts must be positive")
        if min(self.max_connections, self.max_handshaking_connections, self.max_handshaking_per_source) <= 0:
            raise ValueError("connection limits must be positive")
        if not 1 <= self.tcp_lanes <= 16:
            raise ValueError(f"tcp_lanes must be 1 to 16, not {self.tcp_lanes}")
