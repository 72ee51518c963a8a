"""``k8v4`` and ``k4v2``: DiffKV's per-vector asymmetric quantization of K and V (FORMAT.md here).

    layout = quant_layout(("layer", "kv", "token", "head", "channel"))
    frame = K8V4.encode(x, layout)          # K at 8 bits, V at 4, fp16 scale and zero per vector
    y = K8V4.decode(frame)                  # the reference's reconstruction, bit for bit

Lossy: never ``auto``'s pick. The quantizer is defined in ``reference.py``.
"""

from .codec import (K4V2, K8V4, QuantCodec, QuantLayout, decode, decode_blocks, encode, encode_blocks, quant_layout,
                    read_header)
from .format import HEADER_SIZE, QUANT_VERSION, QuantHeader

__all__ = ["K8V4", "K4V2", "QuantCodec", "QuantLayout", "quant_layout", "encode", "decode", "encode_blocks",
           "decode_blocks", "read_header", "QuantHeader", "HEADER_SIZE", "QUANT_VERSION"]
