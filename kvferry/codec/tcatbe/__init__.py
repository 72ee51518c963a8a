"""The ``tca-tbe`` codec: ZipServ's Tensor-Core-Aware Triple Bitmap Encoding for BF16 KV.

    frame = encode(k)           # window of 7 exponents chosen per frame; stored if it won't shrink
    k2 = decode(frame)          # bit-identical; CorruptFrame on bad input

Byte layout: ``FORMAT.md`` beside this file (``format.py`` is its only home in code).
"""

from .codec import (DTYPES, TcaTbeCodebook, TcaTbeCodec, decode, decode_blocks, encode, encode_blocks,
                    encode_reference, read_header)
from .format import FRAME_ID, HEADER_SIZE, TCATBE_VERSION, TcaTbeHeader

__all__ = ["TcaTbeCodec", "TcaTbeCodebook", "encode", "decode", "encode_blocks", "decode_blocks",
           "encode_reference", "read_header", "TcaTbeHeader", "DTYPES", "FRAME_ID", "HEADER_SIZE",
           "TCATBE_VERSION"]
