"""The sidecar's configuration, built once: defaults < YAML file < KVFERRY_* environment < CLI
flags. Passed down as a frozen dataclass; nothing else reads the environment."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.transport.config import UCX_PROGRESS_MODES

from . import placement

MiB = 1 << 20
GPU_SPIN_MS = 50.0  # spin_ms on a GPU host unless set


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"  # control API; beyond loopback only with a token
    port: int = 7700  # control API (HTTP)
    grpc_port: int = 0  # the control API over gRPC too, on ``host`` with the same token; 0: off (the grpc extra)
    data_host: str = "127.0.0.1"  # data listener; beyond loopback only with a peer secret
    data_port: int = 7701  # transport listener
    advertise_host: str = ""  # how peers reach this sidecar's data port; default: host seen by peer
    token: str = ""  # bearer token for the control API; never sent anywhere
    peer_secret: str = ""  # shared by the sidecars of a deployment: the data connection's HMAC handshake
    data_encryption: str = "off"  # on: KV is encrypted on the wire too (AES-256-GCM; every message is authenticated either way)
    max_blocks_per_transfer: int = 1 << 20  # blocks per region pair a transfer may name (sent or announced)
    max_incoming_transfers: int = 64  # transfers peers may have in progress into this sidecar at once
    max_incoming_transfers_per_peer: int = 0  # ... from one peer (source address); 0: three quarters of those
    device: str = "auto"  # where owned regions and the codec run: auto (cuda if present), cpu, cuda, cuda:N
    cpu_threads: int = 0  # torch's intra-op threads for CPU codec work; 0 = torch's default (all cores)
    # The daemon's threads run on: auto (its GPU's NUMA-local CPUs, where sysfs names them), off,
    # or a CPU list (0-15,32-47); always within the CPUs the process may use (``placement.py``).
    cpu_affinity: str = "auto"
    chunk_bytes: int = 0  # raw KV per pipeline chunk; 0 = 256 MiB on a GPU, 4 MiB on the CPU
    max_inflight_chunks: int = 4
    max_concurrent_transfers: int = 64
    max_body_bytes: int = 64 * MiB  # a request body (chunked or not) above this is refused unread
    # An owned region above this is refused (413); 0: half the memory of the device owned regions
    # live on, read at start-up (regions.default_max_bytes). One that does not fit in the memory
    # free at the time is refused too (507).
    max_region_bytes: int = 0
    shm_prefix: str = "kvferry-"  # kind=shm maps only POSIX segments whose name starts with this
    max_connections: int = 256  # authenticated data-port connections at once
    max_handshaking_connections: int = 64  # data-port connections still in the handshake, apart from those
    max_handshaking_per_source: int = 16  # ... from one address at once
    idle_timeout: float = 300.0  # an accepted data connection with nothing in flight this long is closed
    transfer_timeout: float = 30.0  # no progress for this long fails a transfer
    # A chunk waiting past transfer_timeout fails unless its data connection delivered at least this
    # many bytes per second on average meanwhile (to any of its transfers): a dripping peer cannot
    # hold a transfer open, one busy with many transfers over a slow link can.
    min_peer_bytes_per_s: int = 1 << 20
    transport_backend: str = "auto"  # auto, ucxx, tcp
    transport_chunk_bytes: int = 0  # largest message; 0 = a whole pipeline chunk's frame on a GPU, 16 MiB on the CPU
    transport_window_bytes: int = 128 * MiB
    tcp_lanes: int = 0  # TCP sockets per data connection this sidecar dials (large payloads spread over them); 0 = 4 on a GPU, 1 on the CPU
    # A peer on this host (its data address is one of this network namespace's) is dialled over a
    # Unix socket its data listener also accepts on: the tcp backend's small messages skip the TCP
    # stack. Off (and under an emulated link, which stands for a remote peer): TCP only, and no Unix
    # socket is listened on.
    local_socket: bool = True
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    ucx_progress_mode: str = "blocking"  # ucxx's worker progress: blocking (on the event loop), thread, polling, thread-polling
    # After any request or peer message the event loop busy-polls this long, so the next request
    # finds its CPU awake (on virtual GPU hosts a CPU that slept a few ms runs the next request's
    # work 2-4x slower); it costs up to one core while traffic flows. -1: 50 on a GPU, 0 on the CPU
    # (where vLLM's own threads need every core).
    spin_ms: float = -1.0
    # While it busy-polls, the loop moves itself off a CPU that has gone slow (on virtual hosts a
    # CPU can run at half speed for seconds while others run at full), given at least four CPUs to
    # choose from (``spin.Mover``). false: it stays where the kernel puts it.
    loop_moves: bool = True
    log_level: str = "info"
    assumed_link_gbps: float = 12.5  # link speed ``auto`` assumes until it has measured a peer
    # Link emulation for benchmarks on one host, never for serving: pace outgoing data to this many
    # GB/s, take no same-host shortcut, and let ``auto`` assume this speed (0 = off, a real link).
    emulated_link_gbps: float = 0.0

    @property
    def incoming_per_peer(self) -> int:
        """The incoming transfers one peer may have in progress at once: by default a lone sender
        uses most of the budget, and a quarter always stays for the others."""
        return self.max_incoming_transfers_per_peer or max(1, self.max_incoming_transfers * 3 // 4)

    def public(self) -> dict[str, Any]:
        """Settings as printed at start-up, secrets masked."""
        values = dataclasses.asdict(self)
        values["token"] = "***" if self.token else ""
        values["peer_secret"] = "***" if self.peer_secret else ""
        return values

    def check(self) -> None:
        """Values that parse but cannot work, and secure defaults: nothing listens beyond loopback
        without a token and a peer secret.

        Raises:
            ValueError: naming the setting and its value.
        """
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device: {self.device!r} is not auto, cpu, cuda or cuda:N")
        placement.check(self.cpu_affinity)
        if self.transport_backend not in ("auto", "ucxx", "tcp"):
            raise ValueError(f"transport_backend: {self.transport_backend!r} is not auto, ucxx or tcp")
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise ValueError(f"ucx_progress_mode: {self.ucx_progress_mode!r} is not one of {', '.join(UCX_PROGRESS_MODES)}")
        if not 0 <= self.tcp_lanes <= 16:
            raise ValueError(f"tcp_lanes: {self.tcp_lanes} is not 0 (by device) or 1 to 16")
        if self.data_encryption not in ("off", "on"):
            raise ValueError(f"data_encryption: {self.data_encryption!r} is not off or on")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level: {self.log_level!r} is not debug, info, warning or error")
        for name in ("port", "data_port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name}: {getattr(self, name)} is not a port")
        if self.grpc_port and self.grpc_port in (self.port, self.data_port):
            raise ValueError(f"grpc_port: {self.grpc_port} is taken by the REST or data port")
        for name in ("max_inflight_chunks", "max_concurrent_transfers", "max_body_bytes", "max_connections",
                     "max_handshaking_connections", "max_handshaking_per_source", "max_blocks_per_transfer",
                     "max_incoming_transfers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be positive")
        if self.max_incoming_transfers_per_peer < 0:
            raise ValueError(f"max_incoming_transfers_per_peer: {self.max_incoming_transfers_per_peer} must be 0 "
                             "(a quarter of max_incoming_transfers) or positive")
        if self.max_region_bytes < 0:
            raise ValueError(f"max_region_bytes: {self.max_region_bytes} must be 0 (by memory) or positive")
        if self.spin_ms < 0 and self.spin_ms != -1:
            raise ValueError(f"spin_ms: {self.spin_ms} must be -1 (by device) or at least 0")
        if self.transfer_timeout <= 0 or self.idle_timeout <= 0 or self.min_peer_bytes_per_s <= 0:
            raise ValueError("transfer_timeout, idle_timeout and min_peer_bytes_per_s must be positive")
        if not self.token.isascii():
            raise ValueError("token: must be ASCII (an HTTP header carries it)")
        if not _loopback(self.host) and not self.token:  # REST and gRPC alike: both listen on host
            raise ValueError(f"the control API would listen on {self.host} without a token: set KVFERRY_TOKEN "
                             "(or bind it to 127.0.0.1)")
        if self.transport_backend == "ucxx" and not self.peer_secret:
            raise ValueError("transport_backend: ucxx listens on every interface whatever data_host says (ucxx 0.52 "
                             "binds no address): set KVFERRY_PEER_SECRET on every sidecar, or use tcp")
        if self.transport_backend == "ucxx" and self.data_on_ipv6():
            raise ValueError(f"transport_backend: ucxx listens on IPv4 only (ucxx 0.52 binds 0.0.0.0), so peers "
                             f"cannot reach {self.advertise_host or self.data_host}: use tcp for an IPv6 data address")
        if not _loopback(self.data_host) and not self.peer_secret:
            raise ValueError(f"the data port would listen on {self.data_host} without a peer secret: set "
                             "KVFERRY_PEER_SECRET on every sidecar (or bind it to 127.0.0.1)")

    def data_on_ipv6(self) -> bool:
        """Whether peers reach the data port at an IPv6 address (which ucxx's listener does not take)."""
        return ":" in (self.advertise_host or self.data_host)

    def spin_seconds(self, device_type: str) -> float:
        """How long the loop busy-polls after activity, on a ``device_type`` ("cuda", "cpu") engine."""
        if self.spin_ms >= 0:
            return self.spin_ms / 1e3
        return GPU_SPIN_MS / 1e3 if device_type == "cuda" else 0.0


def _loopback(host: str) -> bool:
    """An address (not a name that resolves to one, but ``localhost``) of this host's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _suggest(unknown: Any, known: Any) -> str:
    """" (did you mean ...?)" for the unknown names that are close to a known one, else ""."""
    hints = [(name, match[0]) for name in sorted(map(str, unknown))
             if (match := difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75))]
    if len(hints) == 1:
        return f" (did you mean {hints[0][1]}?)"
    return f" (did you mean {', '.join(f'{m} for {n}' for n, m in hints)}?)" if hints else ""


def _coerce(name: str, value: Any) -> Any:
    """One setting's value in its type.

    Raises:
        ValueError: naming the setting and the value.
    """
    kind = type(getattr(Settings(), name))
    try:
        if name == "ucx_options":
            if isinstance(value, str):  # KEY=VALUE,KEY=VALUE
                return dict(item.split("=", 1) for item in value.split(",") if item)
            return dict(value)
        if kind is bool:
            return str(value).lower() in ("1", "true", "yes", "on")
        if kind in (int, float) and isinstance(value, bool):
            raise TypeError
        converted = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not a valid {kind.__name__}") from None
    if kind is float and converted != converted:
        raise ValueError(f"{name}: {value!r} is not a number")
    return converted


def load(cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | Path | None = None) -> Settings:
    """Merge the sources; unknown keys in the YAML file are an error (typos must not pass)."""
    values: dict[str, Any] = {}
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get("KVFERRY_CONFIG")
    if config_file:
        import yaml

        try:
            document = yaml.safe_load(Path(config_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read {config_file}: {exc}") from None
        if not isinstance(document, dict):
            raise ValueError(f"{config_file} is not a mapping of settings")
        unknown = set(document) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown settings in {config_file}: {sorted(unknown)}{_suggest(unknown, FIELDS)}")
        values.update(document)
    known = {f"KVFERRY_{name.upper()}" for name in FIELDS} | {"KVFERRY_CONFIG"}
    # KVFERRY_CONNECTOR_* belong to the vLLM connector (the engine process), which may share the env.
    unknown_env = sorted(k for k in environ if k.startswith("KVFERRY_") and k not in known
                         and not k.startswith("KVFERRY_CONNECTOR_"))
    if unknown_env:
        raise ValueError(f"unknown settings in the environment: {unknown_env}{_suggest(unknown_env, known)}")
    for name in FIELDS:
        key = f"KVFERRY_{name.upper()}"
        if key in environ:
            values[name] = environ[key]
    for name, value in (cli or {}).items():
        if value is not None and name in FIELDS:
            values[name] = value
    return Settings(**{name: _coerce(name, value) for name, value in values.items()})
