"""Which KV heads a decode rank takes from which prefill rank when the two instances run different
tensor-parallel sizes: pure functions, no I/O.

vLLM splits a layer's KV heads across tensor-parallel ranks in order: with ``H`` KV heads and
``tp`` ranks, rank ``r`` holds heads ``r * H / tp`` to ``(r + 1) * H / tp - 1``; where ``H < tp``
(GQA with few KV heads) each head is replicated on ``tp / H`` ranks and rank ``r`` holds head
``r * H // tp`` alone. An MLA cache (one latent per token) is the same on every rank: one
"head", ``H = 1``, replicated everywhere. So a decode rank needs, for each of its heads, one
prefill rank that holds it; where several do (replicas), the decode ranks spread their reads
over them. Consecutive heads read from one prefill rank form one ``Slice``: one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass


class BadShape(ValueError):
    """A tensor-parallel shape vLLM would not run (heads not split evenly)."""


@dataclass(frozen=True)
class Slice:
    """``count`` KV heads from prefill rank ``rank``'s cache, its heads ``src`` ..., into this
    decode rank's cache at its heads ``dst`` ...."""

    rank: int
    src: int
    dst: int
    count: int


def rank_heads(total: int, tp: int, rank: int) -> range:
    """The KV heads (global indices) rank ``rank`` of ``tp`` holds.

    Raises: BadShape where vLLM could not split ``total`` heads over ``tp`` ranks."""
    if total < 1 or tp < 1 or not 0 <= rank < tp:
        raise BadShape(f"rank {rank} of {tp} with {total} KV heads")
    if total >= tp:
        if total % tp:
            raise BadShape(f"{total} KV heads do not split over {tp} tensor-parallel ranks")
        per = total // tp
        return range(rank * per, (rank + 1) * per)
    if tp % total:
        raise BadShape(f"{tp} tensor-parallel ranks do not replicate {total} KV heads evenly")
    head = rank * total // tp
    return range(head, head + 1)


def plan(total: int, p_tp: int, d_tp: int, d_rank: int) -> list[Slice]:
    """What decode rank ``d_rank`` of ``d_tp`` reads from a prefill of ``p_tp`` ranks, ``total``
    KV heads each layer (1 for MLA): its heads in order, as few slices as possible.

    Raises: BadShape."""
    slices: list[Slice] = []
    for dst, head in enumerate(rank_heads(total, d_tp, d_rank)):
        holders = [r for r in range(p_tp) if head in rank_heads(total, p_tp, r)]
        rank = holders[d_rank % len(holders)]  # replicas: the decode ranks read different ones
        src = head - rank_heads(total, p_tp, rank).start
        last = slices[-1] if slices else None
        if last is not None and last.rank == rank and last.src + last.count == src and last.dst + last.count == dst:
            slices[-1] = Slice(rank, last.src, last.dst, last.count + 1)
        else:
            slices.append(Slice(rank, src, dst, 1))
    return slices


def readers(total: int, p_tp: int, d_tp: int) -> dict[int, list[int]]:
    """Prefill rank -> the decode ranks that read its cache (none for a replica nobody needs)."""
    found: dict[int, list[int]] = {r: [] for r in range(p_tp)}
    for d_rank in range(d_tp):
        for s in plan(total, p_tp, d_tp, d_rank):
            if d_rank not in found[s.rank]:
                found[s.rank].append(d_rank)
    return found


def releases(total: int, p_tp: int, d_tp: int, d_rank: int, loaded: bool) -> list[int]:
    """The prefill ranks whose leases decode rank ``d_rank`` ends itself.

    After a pull (``loaded``): those it alone read, and replicas nobody reads (decode rank
    ``p_rank % d_tp`` ends those). A lease several decode ranks read must outlive every one of their
    pulls, so none of them ends it: the decode's scheduler does, once vLLM reports the request
    loaded on every rank (``shared``). With nothing to pull, every lease is ended by one decode
    rank: its lowest reader, or for one nobody reads, rank ``p_rank % d_tp``."""
    mine = []
    for p_rank, ranks in readers(total, p_tp, d_tp).items():
        if not ranks:
            owner = p_rank % d_tp
        elif len(ranks) == 1 or not loaded:
            owner = ranks[0]
        else:
            continue
        if owner == d_rank:
            mine.append(p_rank)
    return mine


def shared(total: int, p_tp: int, d_tp: int) -> list[int]:
    """The prefill ranks several decode ranks read: ended by the decode's scheduler."""
    return [p_rank for p_rank, ranks in readers(total, p_tp, d_tp).items() if len(ranks) > 1]
