"""The codec's exception tree.

    CodecError
    ├── CorruptFrame        (also ValueError) a frame failed validation; nothing was written
    ├── UnsupportedTensor   (also TypeError)  dtype, rank or device the codec cannot encode
    ├── CodebookMismatch    (also ValueError) codebook for another dtype, or malformed codebook
    ├── OutputMismatch      (also ValueError) ``out=`` has the wrong dtype or element count
    ├── BlockOutOfRange     (also IndexError) a block id outside the cache; nothing read or written
    └── InvalidArgument     (also ValueError) an option out of range (chunk size, axis), or a
                                              name or frame id registered twice

Each also derives from the built-in error it refines, so callers that caught that still do;
errors from torch, numpy or struct are translated into these where the codec meets them.
"""


class CodecError(Exception):
    """Root of every error the codec raises."""


class CorruptFrame(CodecError, ValueError):
    """A frame is malformed, truncated or fails its checksum; decode wrote nothing."""


class UnsupportedTensor(CodecError, TypeError):
    """The tensor's dtype, rank or device cannot be encoded."""


class CodebookMismatch(CodecError, ValueError):
    """The codebook does not fit the tensor (wrong dtype) or is itself malformed."""


class OutputMismatch(CodecError, ValueError):
    """The ``out=`` tensor cannot hold the frame's contents."""


class BlockOutOfRange(CodecError, IndexError):
    """A block id lies outside the cache; no block was read or written."""


class InvalidArgument(CodecError, ValueError):
    """An option or argument the codec cannot take (chunk size, axis, a registry conflict)."""
