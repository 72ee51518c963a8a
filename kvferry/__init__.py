"""kvferry: lossless, compressed KV-cache transfer between the GPU workers of a disaggregated LLM
server. Layers (checked by import-linter): ``cli | api | client`` → ``engine`` → ``codec | transport``.
"""

__version__ = "0.2.0"
__all__ = ["__version__"]
