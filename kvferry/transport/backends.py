"""Which backend carries the links: chosen once, imported only when chosen. The base
(``link.py``) imports no backend, and each backend imports only the base, so ucxx (and UCX's
environment defaults) load only in a process that uses them."""

from __future__ import annotations

import glob
import importlib
import sys
from types import ModuleType

from .config import TransportConfig

# backend name -> the module implementing ``listen`` and ``connect`` over ``link.Link``
MODULES = {"tcp": f"{__package__}.tcp", "ucxx": f"{__package__}.ucx"}


# RDMA devices a process may open: only where one exists does UCX reach another host faster than
# TCP (its TCP path moves GPU payloads at about 2.2 GB/s, the tcp backend with lanes 3.5 to 7).
RDMA_DEVICES = "/dev/infiniband/uverbs*"


def resolve_backend(config: TransportConfig) -> str:
    """The backend that ``config`` selects on this machine: decided once by the caller, logged.
    ``auto`` takes ucxx where it imports and this process can open an RDMA device, else tcp.

    Raises:
        ImportError: ``backend="ucxx"`` but ucxx does not import.
    """
    if config.backend == "tcp" or (config.backend == "auto" and not glob.glob(RDMA_DEVICES)):
        return "tcp"
    try:
        importlib.import_module(MODULES["ucxx"])  # the only module that imports ucxx
    except ImportError:
        if config.backend == "ucxx":
            raise
        return "tcp"
    return "ucxx"


def backend_module(name: str) -> ModuleType:
    """The module of backend ``name`` (``tcp`` for any name but ``ucxx``), imported now."""
    return importlib.import_module(MODULES["ucxx" if name == "ucxx" else "tcp"])


def shutdown_backends() -> None:
    """Release process-wide backend state (ucxx's notifier thread) before the event loop ends."""
    ucx = sys.modules.get(MODULES["ucxx"])
    if ucx is not None:
        ucx.shutdown()
