"""A transfer's chunks: which blocks each carries (``Plan``) and the transport tag each travels
under (``ChunkTags``). Both ends compute them from the announce alone, lazily, so an announce of a
million blocks costs no more than its bytes. Part of the peer protocol (``peer.py``)."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from .errors import ProtocolViolation

TAPER = 8  # a tapered plan's first and last chunks give an eighth of their blocks a chunk of its own


def chunk_tag(transfer_id: str, index: int) -> int:
    """The transport tag of a transfer's chunk ``index``: unguessable without the id."""
    return int.from_bytes(hashlib.blake2b(bytes.fromhex(transfer_id) + index.to_bytes(4, "little"),
                                          digest_size=8).digest(), "little")


class Plan(Sequence):
    """Chunks as (pair index, first block index, block count): pair by pair, ``blocks_per_chunk[p]``
    blocks at a time. Both ends compute it from the announce, by arithmetic: its length and any
    chunk cost O(pairs) however many chunks there are, so an announce costs no more than its
    bytes. ``tapered`` (the TAPERED flag): the first ``1 / TAPER`` of the first chunk and the last
    ``1 / TAPER`` of the last one are chunks of their own, so that on a slow link the first bytes
    leave, and the last are decoded, sooner."""

    def __init__(self, blocks: int, blocks_per_chunk: tuple[int, ...], tapered: bool = False):
        if any(n <= 0 for n in blocks_per_chunk):
            raise ProtocolViolation("zero blocks per chunk")
        self.blocks, self.per_chunk = blocks, blocks_per_chunk
        self._starts = [0]  # index of each pair's first (untapered) chunk
        for n in blocks_per_chunk:
            self._starts.append(self._starts[-1] + -(-blocks // n))
        base = self._starts[-1]
        self._head: list[tuple[int, int, int]] = []  # the tapered ends replace base chunks 0 and base - 1
        self._tail: list[tuple[int, int, int]] = []
        if tapered and base:
            edge = [self._base(0)] if base == 1 else [self._base(0), self._base(base - 1)]
            pair, start, count = edge[0]
            if count // TAPER:
                edge[:1] = [(pair, start, count // TAPER), (pair, start + count // TAPER, count - count // TAPER)]
            pair, start, count = edge[-1]
            if count // TAPER:
                edge[-1:] = [(pair, start, count - count // TAPER), (pair, start + count - count // TAPER, count // TAPER)]
            if base == 1:
                self._head = edge
            else:
                split = 2 if self._base(0)[2] // TAPER else 1
                self._head, self._tail = edge[:split], edge[split:]
        self._middle = base - (1 if self._head else 0) - (1 if self._tail else 0)
        self._length = len(self._head) + self._middle + len(self._tail)

    def _base(self, i: int) -> tuple[int, int, int]:
        pair = bisect.bisect_right(self._starts, i) - 1
        start = (i - self._starts[pair]) * self.per_chunk[pair]
        return pair, start, min(self.per_chunk[pair], self.blocks - start)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        if index < len(self._head):
            return self._head[index]
        index -= len(self._head)
        if index < self._middle:
            return self._base(index + (1 if self._head else 0))
        return self._tail[index - self._middle]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (Plan, list)) else NotImplemented


def chunk_count(blocks: int, blocks_per_chunk: tuple[int, ...]) -> int:
    """How many (untapered) chunks an announce of ``blocks`` blocks per pair makes: arithmetic."""
    return sum(-(-blocks // max(1, n)) for n in blocks_per_chunk)


def plan_chunks(blocks: int, blocks_per_chunk: tuple[int, ...], tapered: bool = False) -> Plan:
    """The chunk plan of a transfer (``Plan``)."""
    return Plan(blocks, blocks_per_chunk, tapered)


class ChunkTags(Sequence):
    """A transfer's chunk tags, each computed when it is asked for (``chunk_tag``)."""

    def __init__(self, transfer_id: str, count: int):
        self.transfer_id, self.count = transfer_id, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [chunk_tag(self.transfer_id, i) for i in range(*index.indices(self.count))]
        if not 0 <= index < self.count:
            raise IndexError(index)
        return chunk_tag(self.transfer_id, index)
