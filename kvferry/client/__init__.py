"""The client side: the SDK (``Client``) an engine process imports without any server code."""

from kvferry.engine.errors import BY_NAME, EngineError, TransferFailed

from .sdk import AsyncClient, Client, blocks_json, packed

__all__ = ["Client", "AsyncClient", "blocks_json", "packed", "TransferFailed", "EngineError", "BY_NAME"]
