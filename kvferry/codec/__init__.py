"""kvferry's KV codecs: pure functions over tensors, each a registry entry.

    codec.names()                       # ['raw', 'splitzip', ...]
    c = codec.get("splitzip")           # c.name, c.lossless, c.capacity(shape, dtype)
    book = c.calibrate(samples)         # book.to_json() / c.codebook_from_json(text)
    frame = c.encode(x, book)           # 1-D uint8 frame, self-describing
    y = c.decode(frame)                 # bit-identical; CorruptFrame on bad input

The module-level ``encode``/``decode``/``calibrate`` are SplitZip's (its frame format is FORMAT.md).
Imports neither ``transport`` nor the layers above.
"""

from .codebook import Codebook, calibrate
from .dtypes import LAYOUTS, FloatLayout, layout_by_name, layout_for
from .errors import (BlockOutOfRange, CodebookMismatch, CodecError, CorruptFrame, InvalidArgument, OutputMismatch,
                     UnsupportedTensor)
from .format import DEFAULT_CHUNK, HEADER_SIZE, VERSION, FrameCodec, Header
from .frames import (decode, decode_blocks, encode, encode_blocks, encode_blocks_into, encode_into,
                     encode_stored, frame_capacity, read_header)
from .raw import RawCodec
from .layout import AXIS_NAMES, BlockLayout
from .registry import Capabilities, Codec, CodecBase, PositionFree, UnknownCodec, codec_of, get, lossless, names, register
from .splitzip import SplitZipCodec
from .entropy import EntropyCodec
from .tcatbe import TcaTbeCodec
from .predictive import PredictiveCodec
from .quant import K4V2, K8V4, QuantCodec
from .lowrank import LowRankCodec

# The registry: one line per codec. Lossless first (``auto`` breaks ties by this order), then
# the lossy ones, which only a transfer that names them gets.
register(RawCodec())
register(SplitZipCodec())
register(EntropyCodec())
register(TcaTbeCodec())
register(PredictiveCodec())
register(K8V4)
register(K4V2)
register(LowRankCodec())

__all__ = [
    "Codec", "Capabilities", "CodecBase", "PositionFree", "BlockLayout", "AXIS_NAMES", "names", "get", "register", "codec_of", "lossless", "UnknownCodec", "RawCodec", "SplitZipCodec",
    "EntropyCodec", "TcaTbeCodec", "PredictiveCodec", "QuantCodec", "K8V4", "K4V2", "LowRankCodec",
    "Codebook", "calibrate", "encode", "decode", "encode_blocks", "decode_blocks", "encode_into",
    "encode_blocks_into", "encode_stored", "frame_capacity", "read_header", "Header", "FrameCodec",
    "CodecError", "CorruptFrame", "UnsupportedTensor", "CodebookMismatch", "OutputMismatch", "BlockOutOfRange",
    "InvalidArgument",
    "FloatLayout", "LAYOUTS", "layout_for", "layout_by_name", "DEFAULT_CHUNK", "HEADER_SIZE", "VERSION",
]
