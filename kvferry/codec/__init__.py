"""kvferry's lossless KV codec: SplitZip exponent coding into self-describing frames.

Pure functions over tensors; imports neither ``transport`` nor ``service``.
"""

from .codebook import Codebook, calibrate
from .dtypes import LAYOUTS, FloatLayout, layout_by_name, layout_for
from .errors import CodebookMismatch, CodecError, CorruptFrame, OutputMismatch, UnsupportedTensor
from .format import DEFAULT_CHUNK, HEADER_SIZE, VERSION, Codec, Header
from .frames import (decode, decode_blocks, encode, encode_blocks, encode_blocks_into, encode_into,
                     frame_capacity, read_header)

__all__ = [
    "Codebook", "calibrate", "encode", "decode", "encode_blocks", "decode_blocks", "encode_into",
    "encode_blocks_into", "frame_capacity", "read_header", "Header", "Codec",
    "CodecError", "CorruptFrame", "UnsupportedTensor", "CodebookMismatch", "OutputMismatch",
    "FloatLayout", "LAYOUTS", "layout_for", "layout_by_name", "DEFAULT_CHUNK", "HEADER_SIZE", "VERSION",
]
