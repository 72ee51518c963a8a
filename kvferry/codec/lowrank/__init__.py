"""The ``lowrank`` codec: ZACK-style projection of each head's K/V vectors onto its leading
principal directions (FORMAT.md beside this file). Lossy; the receiver holds the same codebook.

    book = calibrate(kv, axes=("layer", "kv", "head", "token", "channel"), energy=0.99)
    bound = bind(book, BlockLayout(block_shape, block_axes))   # once per region, before sending
    frame = encode_blocks(cache, ids, bound)                    # frames name the codebook's digest
    decode_blocks(frame, cache2, ids2, bound)                   # CodebookMismatch on another codebook
"""

from .codebook import CODEBOOK_VERSION, LowRankCodebook, calibrate
from .codec import (LowRankBinding, LowRankCodec, bind, decode, decode_blocks, encode, encode_blocks,
                    encode_reference, read_header)
from .format import FRAME_ID, HEADER_SIZE, LOWRANK_VERSION, LowRankHeader

__all__ = ["LowRankCodec", "LowRankCodebook", "LowRankBinding", "LowRankHeader", "calibrate", "bind", "encode",
           "decode", "encode_blocks", "decode_blocks", "encode_reference", "read_header", "FRAME_ID",
           "HEADER_SIZE", "LOWRANK_VERSION", "CODEBOOK_VERSION"]
