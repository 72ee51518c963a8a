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
    """The gather-scatter of every pair's blocks into the receiver's memory (one kernel each on
    a GPU), on ``stream`` (None: the current one); a few blocks are copied one by one, which
    costs fewer driver calls than building index tensors; spreads go as their ids, which the
    kernel spreads (listing 16,384 ids of each side and copying them to the GPU took ~0.3 ms on an
    H100 host)."""
    resolved: dict[int, Ids] = {}
    few = src_blocks.listed is not None and dst_blocks.listed is not None and len(src_blocks) <= FEW_BLOCKS
    # Kernels read torch's current stream, so it is switched once; a listed copy is given the stream.
    with on_stream(None if few else stream):
        for pair, held in zip(pairs, helds):
            target, tensor = held.target, pair.region.tensor
            shape = (target.num_blocks, *pair.region.block_shape)
            if few:
                remote, route = mapper.route(target, shape, tensor.dtype, tensor)
            else:
                remote, route = mapper.tensor(target, shape, tensor.dtype, tensor.device), None
            if target.num_blocks not in resolved:  # checked on the host
                resolved[target.num_blocks] = Ids.of(dst_blocks, target.num_blocks)
            if few and route is not None:
                blockcopy.copy_routed(route, src_blocks.listed, dst_blocks.listed,
                                      current_stream(tensor.device) if stream is None else stream.cuda_stream)
                continue
            if few:
                blockcopy.copy_listed(tensor, src_blocks.listed, remote, dst_blocks.listed, stream)
                continue
            src, dst = pair.index.spread, resolved[target.num_blocks].spread
            if src is not None and dst is not None and src[1] == dst[1]:
                ids = to_stream(torch.tensor(src[0] + dst[0], dtype=torch.int64), tensor.device)
                blockcopy.copy_spread(tensor, ids[:len(src[0])], remote, ids[len(src[0]):], src[1], src[2], dst[2])
                continue
            src_ids, dst_ids = pair.index.with_(resolved[target.num_blocks], tensor.device)
            blockcopy.copy_blocks(tensor, src_ids, remote, dst_ids)
