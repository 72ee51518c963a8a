"""The ``splitzip`` codec: lossless exponent coding of KV (``kvferry/codec/FORMAT.md``).

``reference.py`` defines the streams' bytes in torch, ``gpu.py`` launches the kernels of
``splitzip_cuda.cu`` that write the same bytes, ``codec.py`` is the registry entry. Whole frames
(and the stored frames every codec falls back to) are ``kvferry.codec.frames``.
"""

from .codec import SplitZipCodec

__all__ = ["SplitZipCodec"]
