"""What the REST and gRPC front ends do on the engine, once: each validates its own wire format
into the same request models (``models.py``) and calls these, so both have the same resources,
limits and errors."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from kvferry import __version__, codec
from kvferry.engine.engine import Engine, TransferSpec
from kvferry.engine.errors import BadRequest, NotFound, TransferFailed
from kvferry.engine.regions import RegionSpec
from kvferry.engine.transfers import Transfer

from .models import CODEC, NAME, CalibrateBody, RegionBody, TransferBody, to_blocks

log = logging.getLogger("kvferry.api")

MAX_WAIT = 300.0  # the longest a call may wait for a transfer's end, in seconds
# The longest a call may wait for a transfer a peer is about to announce: one comes within moments
# (its announce is the peer's first message); past that, ask again or ask the peer.
MAX_APPEAR = 5.0


def check_wait(wait: float) -> float:
    """Raises: BadRequest (``wait`` is not 0 to ``MAX_WAIT`` seconds)."""
    if not 0 <= wait <= MAX_WAIT:  # NaN fails too
        raise BadRequest(f"wait: {wait} is not 0 to {MAX_WAIT:g} seconds")
    return wait


def check_appear(appear: float) -> float:
    """Raises: BadRequest (``appear`` is not 0 to ``MAX_APPEAR`` seconds)."""
    if not 0 <= appear <= MAX_APPEAR:  # NaN fails too
        raise BadRequest(f"appear: {appear} is not 0 to {MAX_APPEAR:g} seconds")
    return appear


def health(e: Engine) -> dict[str, Any]:
    """What a peer needs to send here (``data_address``), and what this sidecar runs."""
    return {"status": "ready" if e.ready else "starting", "version": __version__, "backend": e.backend,
            "device": str(e.device), "data_address": e.data_address, "codecs": codec.names(),
            "max_body_bytes": e.settings.max_body_bytes}


async def create_region(e: Engine, body: RegionBody) -> dict[str, Any]:
    """Raises: Conflict, BadRequest, PayloadTooLarge, InsufficientStorage."""
    fields = body.model_dump()
    fields["block_shape"] = tuple(fields["block_shape"])
    fields["axes"] = tuple(fields["axes"]) if fields["axes"] else None
    return (await e.register_region(RegionSpec(**fields))).describe()


def write_blocks(e: Engine, name: str, start: int, count: int, data: bytes) -> None:
    """Overwrite blocks ``start`` to ``start + count - 1``. Raises: NotFound, BadRequest, InvalidBlocks."""
    region = e.regions.get(name)
    if count < 1 or len(data) != count * region.block_bytes:
        raise BadRequest(f"{count} blocks of {name!r} are {count * region.block_bytes} bytes, got {len(data)}")
    region.write_run(start, data)


def start_transfer(e: Engine, body: TransferBody) -> Transfer:
    """Raises: EngineError (refused before it started)."""
    return e.submit(TransferSpec(peer=body.peer, pairs=body.pairs(), src_blocks=to_blocks(body.src_blocks),
                                 dst_blocks=to_blocks(body.dst_blocks), codec=body.codec, codebook=body.codebook,
                                 references=body.references(), transfer_id=body.id))


async def settle(e: Engine, t: Transfer, wait: float) -> tuple[dict[str, Any], int]:
    """(the record, 200) once done within ``wait``, else ({id, state}, 202).

    Raises:
        TransferFailed: it failed or was cancelled within ``wait``.
    """
    if wait:
        try:
            return await e.wait(t.id, wait), 200
        except TransferFailed as exc:
            if exc.state in ("failed", "cancelled"):
                raise
    return {"id": t.id, "state": t.state.value}, 202


async def submit_transfer(e: Engine, body: TransferBody, wait: float) -> tuple[dict[str, Any], int]:
    """Start a transfer and ``settle`` it. Raises: EngineError."""
    return await settle(e, start_transfer(e, body), wait)


async def transfer_record(e: Engine, transfer_id: str, wait: float, appear: float = 0.0) -> dict[str, Any]:
    """The record, once terminal within ``wait`` seconds; ``appear``: first wait up to that long
    (within ``wait``) for a transfer not here yet, one a peer is about to announce. Raises: NotFound."""
    if appear and wait and e.transfers.find(transfer_id) is None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        if await e.transfers.arrival(transfer_id, min(appear, wait)) is None:
            raise NotFound(f"no transfer {transfer_id} (none came within {min(appear, wait):g} s)")
        wait = max(0.0, wait - (loop.time() - began))
    if wait:
        await e.transfers.get(transfer_id).wait(wait)
    return e.status(transfer_id)


async def cancel_transfer(e: Engine, transfer_id: str) -> dict[str, Any]:
    """Cancel a transfer and answer once nothing of it runs any more (``Engine.quiet``, up to
    ``transfer_timeout``): its caller may then give its blocks to other work. A transfer that
    ended already is answered so too (its Conflict), as its last chunk may still be decoding
    into its blocks. Raises: NotFound, Conflict."""
    try:
        return e.cancel(transfer_id)
    finally:
        timeout = e.settings.transfer_timeout
        if not await e.quiet(transfer_id, timeout):
            log.warning("transfer %s: its work still runs %g s after it was cancelled", transfer_id, timeout)


def put_codebook(e: Engine, name: str, codec_name: str, document: str | bytes) -> dict[str, Any]:
    """Raises: BadRequest, UnknownCodec."""
    if not re.fullmatch(NAME, name):
        raise BadRequest("bad codebook name")
    if not re.fullmatch(CODEC, codec_name):
        raise BadRequest("bad codec name")
    return e.put_codebook(name, codec_name, document)


async def calibrate(e: Engine, name: str, body: CalibrateBody) -> dict[str, Any]:
    """Raises: BadRequest, NotFound, UnknownCodec."""
    if not re.fullmatch(NAME, name):
        raise BadRequest("bad codebook name")
    return await e.calibrate_codebook(name, body.codec, body.region, to_blocks(body.blocks), body.token_axis,
                                      body.options)
