"""The typed core: ``Engine`` (regions, codebooks, transfers, the peer protocol), its settings,
metrics and error tree. Plain Python types only; no HTTP below ``kvferry.api``.

Heavy modules load on first use, so ``kvferry.engine.errors`` stays cheap for the client SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "TransferSpec": "transfers", "RegionSpec": "regions", "Blocks": "blocks", "Range": "blocks",
    "Settings": "settings", "State": "transfers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
