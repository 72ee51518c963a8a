"""The vLLM connector's statistics: what a decode worker measured per request, as vLLM collects
it from the workers (``TransferStats``) and shows it in its own ``/metrics`` (``PromMetrics``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from kvferry.engine.errors import NotFound

from .vllm_cache import IncompatibleCache

FAILURE_KINDS = ("incompatible", "lease_gone", "unreachable", "timeout", "transfer", "integrity", "copy")


def failure_kind(error: BaseException | str) -> str:
    """A failed pull's kind, for counting (``kvferry_failures_total{kind=...}``)."""
    text = str(error)
    if isinstance(error, IncompatibleCache) or "IncompatibleCache" in text or "IncompatiblePeer" in text:
        return "incompatible"
    if isinstance(error, NotFound) or "NotFound" in text:
        return "lease_gone"
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)) or "ConnectError" in text:
        return "unreachable"
    if isinstance(error, httpx.TimeoutException) or "not done after" in text or "Timeout" in text:
        return "timeout"
    if "integrity" in text.lower() or "checksum" in text.lower() or "crc" in text.lower():
        return "integrity"
    if "copying the pages" in text:
        return "copy"
    return "transfer"


class TransferStats:
    """The connector's statistics of one interval: per received request its transfer time, bytes
    raw and on the wire and codec; failures by kind. Plain lists and counts (vLLM sends them from
    the workers to its logger process); ``kvferry.vllm.KvferryStats`` is this as vLLM's class."""

    def __init__(self, data: Mapping[str, Any] | None = None):
        self.reset()
        for key, value in (data or {}).items():  # copied: aggregating must not change the caller's lists
            if key in self.data:
                self.data[key] = dict(value) if key == "failures" else list(value)

    def reset(self) -> None:
        self.data = {"transfer_seconds": [], "wait_seconds": [], "bytes_raw": [], "bytes_wire": [], "codec": [],
                     "failures": {}}

    def record(self, entry: Mapping[str, Any]) -> None:
        d = self.data
        d["transfer_seconds"].append(float(entry.get("transfer_seconds") or 0.0))
        d["wait_seconds"].append(float(entry.get("wait_seconds") or 0.0))
        d["bytes_raw"].append(int(entry.get("bytes_raw") or 0))
        d["bytes_wire"].append(int(entry.get("bytes_wire") or 0))
        d["codec"].append(str(entry.get("codec") or "unknown"))

    def fail(self, kind: str) -> None:
        self.data["failures"][kind] = self.data["failures"].get(kind, 0) + 1

    def aggregate(self, other: TransferStats) -> TransferStats:
        for key in ("transfer_seconds", "wait_seconds", "bytes_raw", "bytes_wire", "codec"):
            self.data[key].extend(other.data.get(key, ()))
        for kind, n in other.data.get("failures", {}).items():
            self.data["failures"][kind] = self.data["failures"].get(kind, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n, raw, wire = len(d["transfer_seconds"]), sum(d["bytes_raw"]), sum(d["bytes_wire"])
        times = sorted(d["transfer_seconds"])
        return {"requests": n, "failures": sum(d["failures"].values()),
                "avg_transfer_ms": round(1e3 * sum(times) / n, 3) if n else 0.0,
                "p90_transfer_ms": round(1e3 * times[min(n - 1, int(0.9 * n))], 3) if n else 0.0,
                "avg_wait_ms": round(1e3 * sum(d["wait_seconds"]) / n, 3) if n else 0.0,
                "bytes_raw": raw, "bytes_wire": wire, "ratio": round(raw / wire, 3) if wire else 0.0}

    def is_empty(self) -> bool:
        return not self.data["transfer_seconds"] and not self.data["failures"]

    def take(self) -> TransferStats | None:
        """This interval's statistics (None if nothing happened), and a fresh interval."""
        if self.is_empty():
            return None
        taken = type(self)(self.data)
        self.reset()
        return taken


class PromMetrics:
    """The statistics as Prometheus metrics, registered through the metric classes vLLM hands a
    connector (``build_prom_metrics``), one child per engine."""

    def __init__(self, metric_types: Mapping[type, Any], labelnames: Sequence[str],
                 per_engine_labelvalues: Mapping[int, Sequence[object]]):
        from prometheus_client import Counter, Histogram

        histogram, counter = metric_types[Histogram], metric_types[Counter]
        self.labelnames, self.per_engine = list(labelnames), dict(per_engine_labelvalues)
        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self.transfer = histogram(name="vllm:kvferry_transfer_seconds", buckets=seconds, labelnames=self.labelnames,
                                  documentation="A request's KV transfer, as the prefill's sidecar timed it.")
        self.wait = histogram(name="vllm:kvferry_wait_seconds", buckets=seconds, labelnames=self.labelnames,
                              documentation="A request's pull from its start to its KV in vLLM's cache.")
        self.raw = counter(name="vllm:kvferry_bytes_raw", labelnames=[*self.labelnames, "codec"],
                           documentation="KV bytes received, uncompressed.")
        self.wire = counter(name="vllm:kvferry_bytes_wire", labelnames=[*self.labelnames, "codec"],
                            documentation="KV bytes received as they crossed the wire.")
        self.requests = counter(name="vllm:kvferry_requests", labelnames=[*self.labelnames, "codec"],
                                documentation="Requests whose KV was received, by the codec that carried it.")
        self.failures = counter(name="vllm:kvferry_failures", labelnames=[*self.labelnames, "kind"],
                                documentation="Pulls that failed, by kind (" + ", ".join(FAILURE_KINDS) + ").")
        self.ratio = histogram(name="vllm:kvferry_ratio", labelnames=[*self.labelnames, "codec"],
                               buckets=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0],
                               documentation="A request's compression ratio (raw bytes / wire bytes).")

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        values = list(self.per_engine.get(engine_idx, ()))
        for seconds, wait, raw, wire, codec in zip(data.get("transfer_seconds", ()), data.get("wait_seconds", ()),
                                                   data.get("bytes_raw", ()), data.get("bytes_wire", ()),
                                                   data.get("codec", ())):
            self.transfer.labels(*values).observe(seconds)
            self.wait.labels(*values).observe(wait)
            self.raw.labels(*values, codec).inc(raw)
            self.wire.labels(*values, codec).inc(wire)
            self.requests.labels(*values, codec).inc()
            if wire:
                self.ratio.labels(*values, codec).observe(raw / wire)
        for kind, n in data.get("failures", {}).items():
            self.failures.labels(*values, kind).inc(n)

