"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[str, str, str], tuple] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        # Per transfer, by the codec it used ("" if it ended before one was chosen): what a request
        # cost, and with which codec, is visible per codec.
        self.transfers = Counter("kvferry_transfers", "Transfers that reached a state",
                                 ["state", "direction", "codec"], registry=r)
        self.bytes_raw = Counter("kvferry_bytes_raw", "Uncompressed KV bytes moved", ["direction", "codec"], registry=r)
        self.bytes_wire = Counter("kvferry_bytes_wire", "Bytes put on or taken off the wire", ["direction", "codec"],
                                  registry=r)
        # Lossy codecs are only ever asked for by name; what went through one is counted apart.
        self.lossy_bytes = Counter("kvferry_lossy_bytes_raw", "Uncompressed KV bytes moved through a lossy codec",
                                   ["direction", "codec"], registry=r)
        self.ratio = Histogram("kvferry_compression_ratio", "Raw / wire bytes per finished transfer",
                               buckets=(1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.6, 2.0), registry=r)
        self.codec_seconds = Counter("kvferry_codec_seconds", "Time in the codec", ["op"], registry=r)
        self.wire_seconds = Counter("kvferry_wire_seconds", "Time sending chunks", registry=r)
        self.chunks = Counter("kvferry_chunks", "Pipeline chunks coded and moved (a tapered plan has two more)",
                              ["direction"], registry=r)
        self.latency = Histogram("kvferry_transfer_seconds", "Transfer latency, submit to done",
                                 ["direction", "codec"],
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
                                 registry=r)
        self.inflight_chunks = Gauge("kvferry_inflight_chunks", "Chunks encoded and not yet acknowledged",
                                     registry=r)
        self.active = Gauge("kvferry_active_transfers", "Transfers queued or running", ["direction"], registry=r)
        self.errors = Counter("kvferry_errors", "Failures by kind", ["kind"], registry=r)
        self.regions = Gauge("kvferry_regions", "Registered regions", registry=r)
        # Same-host receivers' memory this sidecar writes into (CUDA IPC handles, shared-memory segments).
        self.peer_memory_mapped = Gauge("kvferry_peer_memory_mapped", "Receivers' lent memories mapped now",
                                        registry=r)
        self.peer_memory_opened = Counter("kvferry_peer_memory_opened", "Receivers' lent memories opened",
                                          registry=r)
        self.spin_seconds = Counter("kvferry_spin_seconds", "Time the event loop busy-polled to keep its CPU awake",
                                    registry=r)
        self.loop_moves = Counter("kvferry_loop_moves", "Times the busy-polling event loop moved off a CPU that ran it "
                                  "slowly", registry=r)
        self.http_requests = Counter("kvferry_http_requests", "Control API requests served", ["method"], registry=r)
        self.info = Info("kvferry_build", "Sidecar build and the transport backend chosen at start-up", registry=r)

    def finished(self, state: str, direction: str, codec: str, raw: int, wire: int, seconds: float) -> None:
        """One transfer reached a terminal state (label children cached: this is per transfer)."""
        key = (state, direction, codec)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.transfers.labels(state, direction, codec), self.bytes_raw.labels(direction, codec),
                self.bytes_wire.labels(direction, codec), self.latency.labels(direction, codec))
        count, raw_bytes, wire_bytes, latency = children
        count.inc()
        if state == "done":
            raw_bytes.inc(raw)
            wire_bytes.inc(wire)
            if wire:
                self.ratio.observe(raw / wire)
            latency.observe(seconds)
