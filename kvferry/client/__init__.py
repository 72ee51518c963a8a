"""The client side: the SDK (``Client``, ``AsyncClient``; ``kvferry.client.grpc`` with the grpc
extra) an engine process imports without any server code, and the typed transfer handles."""

from kvferry.engine.errors import BY_NAME, EngineError, TransferFailed

from .aio import AsyncClient
from .handle import AsyncTransfer, Transfer, TransferStatus
from .sdk import Client, blocks_json, packed

__all__ = ["Client", "AsyncClient", "Transfer", "AsyncTransfer", "TransferStatus", "blocks_json", "packed",
           "TransferFailed", "EngineError", "BY_NAME"]
