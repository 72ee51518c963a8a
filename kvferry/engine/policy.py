"""The ``auto`` codec choice among the registered lossless codecs.

SplitZip's Appendix-B model (a pipeline runs at its slowest stage) plus the pipeline's fill, which
decides small transfers: with k chunks and per-chunk stage times e, w, d the pipeline takes
k·max(e, w, d) + (e + w + d − max). Each codec's encode/decode speed and ratio follow what real
chunks see; the link speed follows what real transfers see. Measured beats modelled: once every
plausible candidate (one the model puts within ``EXPLORE_MARGIN`` of its best) has recently moved
transfers of about this size (same power of two) to this peer, ``auto`` takes the one that was
fastest, since the model assumes stages overlap perfectly and a busy host does not give it that.
To get there it tries each plausible candidate once the model's best has been measured, so that
``auto`` corrects its own model without a user naming every codec; one far behind is never tried.

Transfers in flight together share the link and the codec: a transfer's own wire rate is its
share of the link, and a codec call's speed is what it gets of the device. So the link is learned
as the sum of the shares (a transfer's rate times how many streamed to that peer beside it), the
codecs from calls that ran alone, and the model weighs a new transfer with its shares of both:
the link divided among the transfers streaming to that peer, the codec among all streaming. A
transfer's measured speed says nothing about another codec's when others ran beside it, so the
measured choice (and its learning) is left to transfers that run alone.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field


# A chunk plan is tapered (its first and last chunks split, ``peer.plan_chunks``) where a chunk
# spends this long on the link and its coding (encode and decode) this long. The taper saves seven
# eighths of the first chunk's encode and of the last one's decode, but each end piece spends only
# an eighth of a chunk's time on the link, and the codec call beside it must cover its fixed cost
# in that time, or the link idles. On a GPU that cost is ~0.5 ms an encode and ~0.8 ms a decode (in
# the pipeline, H200): 8 x 0.75 ms. There, at 3.5 ms a chunk (entropy at 50 GB/s), the taper cost
# 1.5-2.3 ms a 2 GiB transfer; at 7 ms (25 GB/s) it saved 0.7-1.1 ms
# (docs/decisions/043-taper-where-end-pieces-cover-a-call.md). A host codec's fixed cost is small
# against its cost per byte. SplitZip's 256 MiB chunk codes in ~0.5 ms on a GPU (the taper measured
# level: decision 004).
TAPER_WIRE_SECONDS = 3e-3
TAPER_GPU_WIRE_SECONDS = 6e-3
TAPER_CODING_SECONDS = 0.8e-3
# A codec predicted at most this much slower than the model's best is worth a measured transfer
# (per peer, size class and ``measured_ttl_s``): the model missed entropy's cost per transfer by
# ~10% on a 50 GB/s link (docs/decisions/007-auto-measures-median-of-five.md), and a try costs at most this.
EXPLORE_MARGIN = 1.25
# A measured speed is the median of this many recent transfers: one slow transfer (a host's
# stall, a 70 ms outlier among 34 ms ones on the GPU hosts measured) does not turn ``auto`` away
# from a codec until the measurement goes stale, as an average that it pulled down did.
MEASURED_SAMPLES = 5


@dataclass
class CodecSpeed:
    """GB/s of raw bytes through the codec on this device, and the ratio it achieves."""

    encode_gbps: float = 0.0
    decode_gbps: float = 0.0
    ratio: float = 1.0


@dataclass
class Policy:
    """Per-codec speeds (in registry order: a tie goes to the first) and per-peer link speeds."""

    codecs: dict[str, CodecSpeed] = field(default_factory=dict)
    assumed_link_gbps: float = 12.5
    link_gbps: dict[str, float] = field(default_factory=dict)
    # (peer, codec, size class) -> (GB/s of raw bytes: the median of the last ``MEASURED_SAMPLES``
    # transfers, when last seen on time.monotonic())
    measured: dict[tuple[str, str, int], tuple[float, float]] = field(default_factory=dict)
    measured_ttl_s: float = 600.0
    # Peers whose first transfer was seen: it opened the connection (a handshake, the peer's
    # first messages), which no later transfer pays. A codebook's first use is left out by the
    # engine (``Pair.fresh_book``); kernels are built by the start-up measurement.
    warmed: set[str] = field(default_factory=set)
    streaming: dict[str, int] = field(default_factory=dict)  # peer -> transfers on the wire to it now
    _recent: dict[tuple[str, str, int], deque] = field(default_factory=dict, repr=False)  # ``measured``'s samples

    def begin_stream(self, peer: str) -> tuple[int, int]:
        """A transfer starts streaming to ``peer``: (to that peer, in all), this one included."""
        self.streaming[peer] = self.streaming.get(peer, 0) + 1
        return self.streaming[peer], sum(self.streaming.values())

    def end_stream(self, peer: str) -> tuple[int, int]:
        """It stopped: (to that peer, in all) as they were, this one included."""
        counts = self.streaming.get(peer, 1), max(1, sum(self.streaming.values()))
        if counts[0] <= 1:
            self.streaming.pop(peer, None)
        else:
            self.streaming[peer] = counts[0] - 1
        return counts

    def sharing(self, peer: str) -> tuple[int, int]:
        """(to ``peer``, in all) a transfer starting now would stream beside, itself included."""
        return self.streaming.get(peer, 0) + 1, sum(self.streaming.values()) + 1

    def predict(self, peer: str, raw_bytes: int, chunk_bytes: int, codec: str,
                sharing: tuple[int, int] = (1, 1)) -> float:
        """Seconds the pipeline needs for ``raw_bytes`` with ``codec`` (inf if its speed is unknown),
        given its ``sharing`` (transfers on the link to that peer, transfers coding on this device)."""
        speed = self.codecs.get(codec)
        if speed is None or not (speed.encode_gbps and speed.decode_gbps):
            return math.inf
        on_link, in_all = sharing
        link = self.link_gbps.get(peer, self.assumed_link_gbps) * 1e9 / on_link
        chunk = min(raw_bytes, chunk_bytes) or 1
        stages = (chunk * in_all / (speed.encode_gbps * 1e9), chunk / (speed.ratio * link),
                  chunk * on_link / (speed.decode_gbps * 1e9))
        return max(raw_bytes, 1) / chunk * max(stages) + sum(stages) - max(stages)

    def choose(self, peer: str, raw_bytes: int, chunk_bytes: int, candidates: list[str] | None = None,
               now: float | None = None) -> tuple[str, str]:
        """(codec, why) for a transfer of ``raw_bytes`` to ``peer``: the fastest measured once
        every plausible candidate (predicted within ``EXPLORE_MARGIN`` of the best) has fresh
        measurements; else a plausible one not yet measured, once the model's best is; else the
        model's best."""
        names = [c for c in (candidates if candidates is not None else self.codecs) if c in self.codecs]
        if not names:
            raise ValueError("no codec to choose from")
        now = time.monotonic() if now is None else now
        sharing = self.sharing(peer)
        times = {c: self.predict(peer, raw_bytes, chunk_bytes, c, sharing) for c in names}
        best = min(names, key=lambda c: times[c])  # min keeps the first of equals
        if sharing[1] > 1:
            return best, (f"predicted {' vs '.join(f'{c} {times[c] * 1e3:.2f} ms' for c in names)} with its shares: "
                          f"the link ({self.link_gbps.get(peer, self.assumed_link_gbps):.2f} GB/s) among "
                          f"{sharing[0]} transfers, the codecs among {sharing[1]}")
        plausible = [c for c in sorted(names, key=lambda c: times[c]) if times[c] <= times[best] * EXPLORE_MARGIN]
        size_class = raw_bytes.bit_length()
        fresh = {c: e[0] for c in names
                 if (e := self.measured.get((peer, c, size_class))) is not None and now - e[1] <= self.measured_ttl_s}
        if len(fresh) > 1 and all(c in fresh for c in plausible):
            fastest = max(fresh, key=lambda c: fresh[c])
            listed = " vs ".join(f"{c} {fresh[c]:.2f}" for c in names if c in fresh)
            return fastest, f"measured {listed} GB/s for transfers of this size to this peer"
        predicted = " vs ".join(f"{c} {times[c] * 1e3:.2f} ms" for c in names)
        untried = [c for c in plausible if c not in fresh]
        if best in fresh and untried:
            return untried[0], (f"trying {untried[0]}: predicted {predicted}, within {EXPLORE_MARGIN:g}× of "
                                f"{best}, which is measured ({fresh[best]:.2f} GB/s) at this size to this peer")
        link = self.link_gbps.get(peer, self.assumed_link_gbps)
        detail = ", ".join(f"{c} {s.encode_gbps:.2f}/{s.decode_gbps:.2f} GB/s ×{s.ratio:.3f}"
                           for c, s in self.codecs.items() if c in names)
        return best, (f"predicted {predicted} (link {link:.2f} GB/s{'' if peer in self.link_gbps else ' assumed'}; "
                      f"{detail})")

    def tapers(self, peer: str, chunk_bytes: int, codec: str, on_gpu: bool = False) -> bool:
        """Whether a transfer to ``peer`` should taper its chunk plan (``peer.plan_chunks``): a
        full chunk spends at least ``TAPER_WIRE_SECONDS`` on the link (``TAPER_GPU_WIRE_SECONDS``
        coded ``on_gpu``) and ``TAPER_CODING_SECONDS`` being coded, so that the two messages the
        taper adds, and the codec calls beside its end pieces, cost less than what it saves at
        both ends (seven eighths of a chunk's encode before the first byte leaves, and of its
        decode after the last arrives)."""
        speed = self.codecs.get(codec)
        if speed is None or speed.encode_gbps <= 0 or speed.decode_gbps <= 0:
            return False
        link = self.link_gbps.get(peer, self.assumed_link_gbps) * 1e9
        coding = chunk_bytes / (speed.encode_gbps * 1e9) + chunk_bytes / (speed.decode_gbps * 1e9)
        wire = TAPER_GPU_WIRE_SECONDS if on_gpu else TAPER_WIRE_SECONDS
        return chunk_bytes / max(speed.ratio, 1.0) / link >= wire and coding >= TAPER_CODING_SECONDS

    def observe_transfer(self, peer: str, codec: str, raw_bytes: int, seconds: float, now: float | None = None,
                         alone: bool = True) -> None:
        """A whole transfer's speed, as the sender saw it (fixed costs included); not the first
        to a peer (see ``warmed``), nor one that shared the link or the codecs (``alone``)."""
        if peer not in self.warmed:
            self.warmed.add(peer)
            return
        if alone and seconds > 0 and raw_bytes >= 1 << 20:
            now = time.monotonic() if now is None else now
            key = (peer, codec, raw_bytes.bit_length())
            old = self.measured.get(key)
            recent = self._recent.setdefault(key, deque(maxlen=MEASURED_SAMPLES))
            if old is None or now - old[1] > self.measured_ttl_s:
                recent.clear()
            recent.append(raw_bytes / seconds / 1e9)
            self.measured[key] = (statistics.median(recent), now)

    def observe_link(self, peer: str, wire_bytes: int, seconds: float, sharing: int = 1) -> None:
        """A transfer's wire rate, its share of a link it streamed on beside ``sharing - 1`` others."""
        if seconds > 0 and wire_bytes > 1 << 20:
            self.link_gbps[peer] = _follow(self.link_gbps.get(peer), wire_bytes / seconds / 1e9 * max(1, sharing))

    def observe_codec(self, codec: str, direction: str, raw_bytes: int, seconds: float, alone: bool = True) -> None:
        """Follow the codec speed real chunks see (the start-up sample can be taken while the
        machine is busy starting, and a GPU shares its bandwidth with the serving engine); only
        calls that ran ``alone``: the model divides the codec among concurrent transfers itself."""
        speed = self.codecs.get(codec)
        if alone and speed is not None and seconds > 0 and raw_bytes >= 1 << 20:
            name = f"{direction}_gbps"
            setattr(speed, name, _follow(getattr(speed, name), raw_bytes / seconds / 1e9))

    def observe_ratio(self, codec: str, raw_bytes: int, wire_bytes: int) -> None:
        """Follow the ratio real transfers achieve (their data, not the start-up sample)."""
        speed = self.codecs.get(codec)
        if speed is not None and wire_bytes > 1 << 20:
            speed.ratio = _follow(speed.ratio, raw_bytes / wire_bytes)


def _follow(old: float | None, sample: float) -> float:
    """Exponential moving average that starts at the first sample (0 or None = none yet)."""
    return sample if not old else 0.7 * old + 0.3 * sample
