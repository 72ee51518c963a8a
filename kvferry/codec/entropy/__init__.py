"""The ``entropy`` codec: channel-aware static Huffman coding of KV (FORMAT.md, "entropy").

    book = calibrate(k_layers, token_axis=2)    # [layers, heads, tokens, head_dim] samples
    frame = encode(k, book)                     # tables and context map travel in the frame
    k2 = decode(frame)                          # bit-identical; CorruptFrame on bad input
"""

from .codebook import DEFAULT_PROB_BITS, DEFAULT_TABLES, EntropyCodebook, calibrate, calibrate_blocks
from .codec import EntropyCodec, decode, decode_blocks, encode, encode_blocks, read_header
from .format import DEFAULT_CHUNK, ENTROPY_VERSION, FRAME_ID, HEADER_SIZE, EntropyHeader
from .symbols import Geometry

__all__ = ["EntropyCodec", "EntropyCodebook", "calibrate", "calibrate_blocks", "encode", "decode", "encode_blocks", "decode_blocks",
           "read_header", "EntropyHeader", "Geometry", "DEFAULT_CHUNK", "DEFAULT_TABLES", "DEFAULT_PROB_BITS",
           "ENTROPY_VERSION", "FRAME_ID", "HEADER_SIZE"]
