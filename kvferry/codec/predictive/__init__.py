"""The ``predictive`` codec: speculative KV coding against a predictor's KV (byte layout: format.py).

    book = calibrate_predictive(target_kv, predictor_kv, axes=("layer", "kv", "head", "token", "channel"))
    bound = bind(book, layout, reference)       # reference: the predictor's KV region, [blocks, *layout.shape]
    frame = encode(x, bound)                    # x: the target's KV, shaped like the reference
    x2 = decode(frame, bound)                   # bit-identical; CorruptFrame / CodebookMismatch on bad input
"""

from .codebook import CODEBOOK_VERSION, SIGMA_MIN, PredictiveCodebook, calibrate_predictive
from .codec import (NEEDS_REFERENCE, PredictiveBound, PredictiveCodec, bind, decode, decode_blocks, encode,
                    encode_blocks, read_header)
from .format import FRAME_ID, HEADER_SIZE, PREDICTIVE_VERSION, PredictiveHeader
from .model import MIX, MIX_WEIGHTS, PROB_BITS

__all__ = ["PredictiveCodec", "PredictiveCodebook", "PredictiveBound", "calibrate_predictive", "bind", "encode",
           "decode", "encode_blocks", "decode_blocks", "read_header", "PredictiveHeader", "NEEDS_REFERENCE",
           "CODEBOOK_VERSION", "PREDICTIVE_VERSION", "FRAME_ID", "HEADER_SIZE", "SIGMA_MIN", "MIX", "MIX_WEIGHTS",
           "PROB_BITS"]
