"""The sidecar's configuration, built once: defaults < YAML file < KVFERRY_* environment < CLI
flags. Passed down as a frozen dataclass; nothing else reads the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"  # control API; beyond loopback only with a token
    port: int = 7700  # control API (HTTP)
    data_host: str = "127.0.0.1"  # data listener; beyond loopback only with a peer secret
    data_port: int = 7701  # transport listener
    advertise_host: str = ""  # how peers reach this sidecar's data port; default: host seen by peer
    token: str = ""  # bearer token for the control API; never sent anywhere
    peer_secret: str = ""  # shared by the sidecars of a deployment: the data connection's HMAC handshake
    device: str = "auto"  # where owned regions and the codec run: auto (cuda if present), cpu, cuda, cuda:N
    cpu_threads: int = 0  # torch's intra-op threads for CPU codec work; 0 = torch's default (all cores)
    chunk_bytes: int = 0  # raw KV per pipeline chunk; 0 = 256 MiB on a GPU, 4 MiB on the CPU
    max_inflight_chunks: int = 4
    max_concurrent_transfers: int = 64
    max_body_bytes: int = 64 * MiB
    transfer_timeout: float = 30.0  # no progress for this long fails a transfer
    transport_backend: str = "auto"  # auto, ucxx, tcp
    transport_chunk_bytes: int = 0  # largest message; 0 = a whole pipeline chunk's frame on a GPU, 16 MiB on the CPU
    transport_window_bytes: int = 128 * MiB
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    log_level: str = "info"
    link_gbps: float = 0.0  # benchmarks only: pace outgoing data to this many GB/s (0 = off)
    assumed_link_gbps: float = 12.5  # link speed ``auto`` assumes until it has measured a peer
    fault_corrupt_chunk: int = -1  # testing only: flip a byte of this chunk index on the wire

    def public(self) -> dict[str, Any]:
        """Settings as printed at start-up, secrets masked."""
        values = dataclasses.asdict(self)
        values["token"] = "***" if self.token else ""
        values["peer_secret"] = "***" if self.peer_secret else ""
        return values

    def check(self) -> None:
        """Secure by default: nothing listens beyond loopback without a token and a peer secret.

        Raises:
            ValueError: a non-loopback bind without the secret that guards it.
        """
        if not _loopback(self.host) and not self.token:
            raise ValueError(f"the control API would listen on {self.host} without a token: set KVFERRY_TOKEN "
                             "(or bind it to 127.0.0.1)")
        if not _loopback(self.data_host) and not self.peer_secret:
            raise ValueError(f"the data port would listen on {self.data_host} without a peer secret: set "
                             "KVFERRY_PEER_SECRET on every sidecar (or bind it to 127.0.0.1)")


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(name: str, value: Any) -> Any:
    kind = type(getattr(Settings(), name))
    if name == "ucx_options":
        if isinstance(value, str):  # KEY=VALUE,KEY=VALUE
            return dict(item.split("=", 1) for item in value.split(",") if item)
        return dict(value)
    if kind is bool:
        return str(value).lower() in ("1", "true", "yes", "on")
    return kind(value)


def load(cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | Path | None = None) -> Settings:
    """Merge the sources; unknown keys in the YAML file are an error (typos must not pass)."""
    values: dict[str, Any] = {}
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get("KVFERRY_CONFIG")
    if config_file:
        import yaml

        document = yaml.safe_load(Path(config_file).read_text()) or {}
        unknown = set(document) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown settings in {config_file}: {sorted(unknown)}")
        values.update(document)
    for name in FIELDS:
        key = f"KVFERRY_{name.upper()}"
        if key in environ:
            values[name] = environ[key]
    for name, value in (cli or {}).items():
        if value is not None and name in FIELDS:
            values[name] = value
    return Settings(**{name: _coerce(name, value) for name, value in values.items()})
