"""A same-host write: a transfer's blocks copied straight into memory the receiver lent
(CUDA IPC or host shared memory, ``leases.py``), one kernel per region pair."""

from __future__ import annotations

import torch

from kvferry.codec import blockcopy
from kvferry.codec.staging import current_stream, on_stream

from .blocks import Blocks, Ids, to_stream
from .ipc import Mapper
from .leases import Held
from .links import Pair

FEW_BLOCKS = 4  # a same-host write of at most this many listed blocks copies them one by one


def write_blocks(mapper: Mapper, src_blocks: Blocks, dst_blocks: Blocks, pairs: list[Pair], helds: list[Held],
                 stream: torch.cuda.Stream | None = None) -> None:
    """The gather-scatter of every pair's blocks into the receiver's memory, on ``stream`` (None:
    the current one). Between GPUs that reach each other, listed blocks take the lent view's
    route: a few go one driver copy each, up to ``blockcopy.LISTED_MAX`` in one kernel with the
    ids among its arguments; both launched on the stream's handle, without making it torch's
    current one. Longer lists and spreads go as index tensors into one kernel each (a spread
    as its ids, which the kernel spreads: listing 16,384 ids of each side and copying them to
    the GPU took ~0.3 ms on an H100 host)."""
    resolved: dict[int, Ids] = {}
    listed = src_blocks.listed is not None and dst_blocks.listed is not None
    few = listed and len(src_blocks) <= FEW_BLOCKS
    routed = listed and len(src_blocks) <= blockcopy.LISTED_MAX
    for pair, held in zip(pairs, helds):
        target, tensor = held.target, pair.region.tensor
        shape = (target.num_blocks, *pair.region.block_shape)
        if target.num_blocks not in resolved:  # checked on the host
            resolved[target.num_blocks] = Ids.of(dst_blocks, target.num_blocks)
        if routed:
            remote, route = mapper.route(target, shape, tensor.dtype, tensor)
        else:
            remote, route = mapper.tensor(target, shape, tensor.dtype, tensor.device), None
        if route is not None:
            handle = current_stream(tensor.device) if stream is None else stream.cuda_stream
            if few:
                blockcopy.copy_routed(route, src_blocks.listed, dst_blocks.listed, handle)
                continue
            if blockcopy.copy_by_value(route, src_blocks.listed, dst_blocks.listed, handle):
                continue
        if few:
            blockcopy.copy_listed(tensor, src_blocks.listed, remote, dst_blocks.listed, stream)
            continue
        with on_stream(stream):  # kernels and torch's copies read torch's current stream
            _gather_scatter(pair, resolved[target.num_blocks], tensor, remote)


def _gather_scatter(pair: Pair, dst_ids: Ids, tensor: torch.Tensor, remote: torch.Tensor) -> None:
    """One pair's blocks by index tensors, on torch's current stream."""
    src, dst = pair.index.spread, dst_ids.spread
    if src is not None and dst is not None and src[1] == dst[1]:
        ids = to_stream(torch.tensor(src[0] + dst[0], dtype=torch.int64), tensor.device)
        blockcopy.copy_spread(tensor, ids[:len(src[0])], remote, ids[len(src[0]):], src[1], src[2], dst[2])
        return
    src_ids, dst_ids_ = pair.index.with_(dst_ids, tensor.device)
    blockcopy.copy_blocks(tensor, src_ids, remote, dst_ids_)
