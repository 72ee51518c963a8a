"""The codec's exception tree.

    CodecError
    ├── CorruptFrame        (also ValueError) a frame failed validation; nothing was written
    ├── UnsupportedTensor   (also TypeError)  dtype, rank or device the codec cannot encode
    ├── CodebookMismatch    (also ValueError) codebook for another dtype, or malformed codebook
    └── OutputMismatch      (also ValueError) ``out=`` has the wrong dtype or element count
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
