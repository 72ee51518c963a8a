"""Block lists: explicit ids, ids each spread over ``count`` ids ``stride`` apart, or ranges
(``start``, ``count``, ``stride``), resolved and checked once at submit into an index tensor the
hot path uses as it is (``Ids``: on the host, copied to the GPU once, where first needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .errors import InvalidBlocks

MAX_BLOCKS = 1 << 20


class Range(NamedTuple):
    """``count`` ids from ``start``, ``stride`` apart (stride may be negative, not zero). A named
    tuple, not a dataclass: a peer's announce may carry thousands, built in a few µs each less."""

    start: int
    count: int
    stride: int = 1


class RangeTable(Sequence):
    """Ranges as three integer columns, for block lists decoded from a peer's message: thousands
    of ranges cost no Python object each (building them stalled the loop and fed the garbage
    collector). Reads as a sequence of ``Range``."""

    __slots__ = ("starts", "counts", "strides", "total")

    def __init__(self, starts: np.ndarray, counts: np.ndarray, strides: np.ndarray):
        self.starts, self.counts, self.strides = (np.asarray(c, dtype=np.int64) for c in (starts, counts, strides))
        self.total = int(self.counts.sum())

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return RangeTable(self.starts[i], self.counts[i], self.strides[i])
        return Range(int(self.starts[i]), int(self.counts[i]), int(self.strides[i]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash((self.starts.tobytes(), self.counts.tobytes(), self.strides.tobytes()))

    def __repr__(self) -> str:
        return f"RangeTable({len(self)} ranges, {self.total} ids)"


def _columns(ranges: Sequence[Range]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, counts, strides) of any sequence of ranges, as int64 arrays."""
    if isinstance(ranges, RangeTable):
        return ranges.starts, ranges.counts, ranges.strides
    table = np.array([(r.start, r.count, r.stride) for r in ranges], dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


@dataclass(frozen=True)
class Blocks:
    """Either ``ids`` or ``ranges`` (exactly one). ``spread`` (``count``, ``stride``), with ids:
    each id ``b`` stands for ``b, b + stride, ...``, ``count`` of them: a vLLM block across a
    cache's layers and K/V, one short list where ranges would repeat the same count and stride."""

    ids: tuple[int, ...] | None = None
    ranges: tuple[Range, ...] | RangeTable | None = None
    spread: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.ranges is None):
            raise InvalidBlocks("give block ids or ranges, not both or neither")
        if self.spread is not None and (self.ids is None or self.spread[0] <= 0 or self.spread[1] == 0):
            raise InvalidBlocks("a spread goes with block ids and needs count > 0 and a stride other than 0")

    @property
    def listed(self) -> tuple[int, ...] | None:
        """The ids themselves, where they are all there is (no ranges, no spread)."""
        return self.ids if self.spread is None else None

    @classmethod
    def of(cls, value: Blocks | list[int] | tuple[int, ...] | range) -> Blocks:
        if isinstance(value, Blocks):
            return value
        if isinstance(value, range):
            return cls(ranges=(Range(value.start, len(value), value.step),))
        return cls(ids=tuple(int(i) for i in value))

    def __len__(self) -> int:
        if self.ids is not None:
            return len(self.ids) * (self.spread[0] if self.spread else 1)
        if isinstance(self.ranges, RangeTable):
            return self.ranges.total
        return sum(r.count for r in self.ranges)

    def _check_small(self, num_blocks: int) -> bool:
        """Check a short list of ids (the latency path: plain Python is faster than a tensor);
        False, unchecked, for anything else.

        Raises:
            InvalidBlocks: an id outside ``0..num_blocks-1``, or repeated.
        """
        if self.listed is None or not 0 < len(self.ids) <= 256:
            return False
        low, high = min(self.ids), max(self.ids)
        if low < 0 or high >= num_blocks:
            raise InvalidBlocks(f"block ids must be in 0..{num_blocks - 1}, got {low}..{high}")
        if len(set(self.ids)) != len(self.ids):
            raise InvalidBlocks("block ids repeat")
        return True

    def _check_spread(self, num_blocks: int) -> bool:
        """Check a spread whose ids lie within one stride of each other (vLLM's blocks across a
        cache's layers: no two spreads can meet) on its ids alone, without listing every block;
        False, unchecked, for anything else.

        Raises:
            InvalidBlocks: a block outside ``0..num_blocks-1``, or a repeated id.
        """
        if self.spread is None or not self.ids or len(self) > MAX_BLOCKS:
            return False
        count, stride = self.spread
        low, high = min(self.ids), max(self.ids)
        reach = (count - 1) * stride
        if min(low, low + reach) < 0 or max(high, high + reach) >= num_blocks:
            raise InvalidBlocks(f"block ids must be in 0..{num_blocks - 1}, got {min(low, low + reach)}.."
                                f"{max(high, high + reach)}")
        if high - low >= abs(stride):
            return False
        if len(set(self.ids)) != len(self.ids):
            raise InvalidBlocks("block ids repeat")
        return True

    def resolve(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ids as an int64 tensor on ``device``.

        Raises:
            InvalidBlocks: empty, over ``MAX_BLOCKS``, outside ``0..num_blocks-1``, or repeated.
        """
        n = len(self)
        if n == 0:
            raise InvalidBlocks("no blocks given")
        if n > MAX_BLOCKS:
            raise InvalidBlocks(f"{n} blocks is over the limit of {MAX_BLOCKS}")
        if n > num_blocks:  # checked before anything is built: they cannot all be distinct ids of it
            raise InvalidBlocks(f"{n} blocks do not fit a region of {num_blocks} without repeating")
        if self.ranges:
            starts, counts, strides = _columns(self.ranges)
            lasts = starts + strides * (counts - 1)
            outside = (counts > 0) & ~((0 <= starts) & (starts < num_blocks) & (0 <= lasts) & (lasts < num_blocks))
            if outside.any():
                raise InvalidBlocks(f"block ids must be in 0..{num_blocks - 1}, "
                                    f"range {self.ranges[int(outside.argmax())]} is not")
        if self._check_small(num_blocks):
            return torch.tensor(self.ids, dtype=torch.int64, device=device)
        if self._check_spread(num_blocks):
            return _outer(self.ids, *self.spread, device)
        if self.spread is not None:
            ids = _outer(self.ids, *self.spread)
        elif self.ids is not None:
            ids = torch.tensor(self.ids, dtype=torch.int64)
        else:
            _, counts, strides = _columns(self.ranges)
            bad = (counts < 0) | (strides == 0)
            if bad.any():
                raise InvalidBlocks(f"range {self.ranges[int(bad.argmax())]} needs count >= 0 and a stride other than 0")
            ids = _expand(self.ranges, n)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_blocks:
            raise InvalidBlocks(f"block ids must be in 0..{num_blocks - 1}, got {low}..{high}")
        if torch.bincount(ids, minlength=1).max() > 1:
            raise InvalidBlocks("block ids repeat")
        return ids.to(device)


def _expand(ranges: Sequence[Range], n: int) -> torch.Tensor:
    """The ``n`` ids of ``ranges`` in a few tensor operations, not one per range (a request across
    a cache's layers is one range per block, all alike: a single outer sum)."""
    starts, counts, strides = _columns(ranges)
    if (counts == counts[0]).all() and (strides == strides[0]).all():
        return _outer(starts.tolist(), int(counts[0]), int(strides[0]))
    starts, counts, strides = (torch.from_numpy(c) for c in (starts, counts, strides))
    firsts = torch.cumsum(counts, 0) - counts  # where each range begins in the list
    step = torch.arange(n, dtype=torch.int64) - torch.repeat_interleave(firsts, counts, output_size=n)
    return torch.repeat_interleave(starts, counts, output_size=n) + step * torch.repeat_interleave(
        strides, counts, output_size=n)


class Ids:
    """Checked block ids on the host, and their copy on a device made once, when first asked for.

    Each CUDA call on a sidecar's request path costs tens of microseconds on the GPU hosts measured
    (a spread list built on the GPU: ~0.3 ms), so ids are built on the host, and a path that never
    indexes on the GPU (a few blocks copied one by one, blocks written before their announce)
    never copies them; one that does copies them with the other side's ids in one go (``with_``).
    A spread (vLLM's blocks across a cache's layers) stays its short id list until every block's
    id is asked for: a kernel that spreads the ids itself needs only those (``spread``).
    """

    def __init__(self, host: torch.Tensor | None, listed: tuple[int, ...] = (),
                 spread: tuple[int, int] | None = None):
        self._host, self._listed, self._spread = host, listed, spread
        self._devices: dict[torch.device, torch.Tensor] = {}
        self._staged: dict[torch.device, torch.Tensor] = {}  # copied without a wait (``with_``)

    @classmethod
    def of(cls, blocks: Blocks, num_blocks: int) -> Ids:
        """``blocks`` checked against a region of ``num_blocks``; a short list or a spread stays
        its ids until a tensor of every block is asked for (a one-block write never asks).

        Raises:
            InvalidBlocks: as ``Blocks.resolve``.
        """
        if blocks._check_small(num_blocks):
            return cls(None, blocks.ids)
        if blocks._check_spread(num_blocks):
            return cls(None, blocks.ids, blocks.spread)
        return cls(blocks.resolve(num_blocks))

    @property
    def host(self) -> torch.Tensor:
        if self._host is None:
            self._host = (_outer(self._listed, *self._spread) if self._spread is not None
                          else torch.tensor(self._listed, dtype=torch.int64))
        return self._host

    @property
    def spread(self) -> tuple[tuple[int, ...], int, int] | None:
        """(ids, count, stride) where these are a checked spread: block ``i * count + j`` is
        ``ids[i] + j * stride``."""
        return None if self._spread is None else (self._listed, *self._spread)

    def __len__(self) -> int:
        if self._host is not None:
            return self._host.numel()
        return len(self._listed) * (self._spread[0] if self._spread is not None else 1)

    def on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.host
        ids = self._devices.get(device)
        if ids is None:
            ids = self._devices[device] = self.host.to(device)
        return ids

    def with_(self, other: Ids, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(these ids, ``other``'s) on ``device``, with at most one copy for both. On a GPU the
        copy is queued on the current stream (``to_stream``) and kept apart from ``on``'s: only
        work on that stream may read them (a same-host write's, on its sidecar's encode stream)."""
        if device.type != "cuda":
            if device in self._devices or device in other._devices:
                return self.on(device), other.on(device)
            both = torch.cat((self.host, other.host)).to(device)
            self._devices[device], other._devices[device] = both[:len(self)], both[len(self):]
            return self._devices[device], other._devices[device]
        mine, theirs = self._staged.get(device), other._staged.get(device)
        if mine is None and theirs is None:
            both = to_stream(torch.cat((self.host, other.host)), device)
            mine, theirs = both[:len(self)], both[len(self):]
        mine = to_stream(self.host, device) if mine is None else mine
        theirs = to_stream(other.host, device) if theirs is None else theirs
        self._staged[device], other._staged[device] = mine, theirs
        return mine, theirs


def to_stream(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``ids`` (on the host) copied to ``device`` on its current stream, staged through pinned
    memory: a copy from pageable memory waits for the GPU, ~0.33 ms for 2 KiB of ids in a sidecar
    on an H200 host, a third of a 256 MiB same-host write's time before its kernel. Torch's
    pinned allocator reuses the staging buffer only once the copy is done."""
    if torch.device(device).type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def _outer(starts: Sequence[int], count: int, stride: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` ids ``stride`` apart from each start, start by start, on ``device``: built with
    NumPy, whose few calls cost half of torch's here (on the request path)."""
    offsets = np.arange(0, count * stride, stride, dtype=np.int64)  # stride is never 0
    ids = torch.from_numpy(np.add.outer(np.fromiter(starts, np.int64, len(starts)), offsets).ravel())
    return ids if torch.device(device).type == "cpu" else ids.to(device)
