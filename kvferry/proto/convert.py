"""kvferry.v1 messages <-> the REST API's JSON shapes, in one place for both ends: the server
builds messages from the engine's records, the client turns them back into the same dicts, so
``TransferStatus.from_record`` and every caller read one shape whichever front end answered."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kvferry.proto.v1 import blocks_pb2, regions_pb2, transfers_pb2

STATES = ("queued", "running", "done", "failed", "cancelled")
_STATE_VALUE = {name: transfers_pb2.TransferState.Value(f"TRANSFER_STATE_{name.upper()}") for name in STATES}
_STATE_NAME = {value: name for name, value in _STATE_VALUE.items()}
_OPTIONAL = ("ratio", "seconds", "error", "error_kind")


def transfer_message(record: Mapping[str, Any]) -> transfers_pb2.Transfer:
    """A transfer record (``Transfer.public()``) as a message."""
    message = transfers_pb2.Transfer(
        id=record["id"], direction=record["direction"], state=_STATE_VALUE[record["state"]], peer=record["peer"],
        regions=[transfers_pb2.RegionPair(src=p["src"], dst=p["dst"]) for p in record["regions"]],
        blocks=record["blocks"], blocks_done=record["blocks_done"], codec=record["codec"],
        chosen_codec=record["chosen_codec"], choice_reason=record["choice_reason"], lossy=record["lossy"],
        bytes_raw=record["bytes_raw"], bytes_wire=record["bytes_wire"], stages=record["stages"],
        created=record["created"])
    for name in _OPTIONAL:
        if record.get(name) is not None:
            setattr(message, name, record[name])
    return message


def transfer_record(message: transfers_pb2.Transfer) -> dict[str, Any]:
    """A message as the REST API's transfer JSON."""
    regions = [{"src": p.src, "dst": p.dst} for p in message.regions]
    first = regions[0] if regions else {"src": "", "dst": ""}
    record: dict[str, Any] = {
        "id": message.id, "direction": message.direction, "state": _STATE_NAME.get(message.state, "unspecified"),
        "peer": message.peer, "regions": regions, "src_region": first["src"], "dst_region": first["dst"],
        "blocks": message.blocks, "blocks_done": message.blocks_done, "codec": message.codec,
        "chosen_codec": message.chosen_codec, "choice_reason": message.choice_reason, "lossy": message.lossy,
        "bytes_raw": message.bytes_raw, "bytes_wire": message.bytes_wire, "stages": dict(message.stages),
        "created": message.created}
    for name in _OPTIONAL:
        record[name] = getattr(message, name) if message.HasField(name) else None
    return record


def blocks_message(form: list[int] | Mapping[str, Any]) -> blocks_pb2.Blocks:
    """A block list in the REST API's form (``kvferry.client.blocks_json``) as a message."""
    if not isinstance(form, Mapping):
        return blocks_pb2.Blocks(ids=blocks_pb2.BlockIds(ids=list(form)))
    if "ranges" in form:
        return blocks_pb2.Blocks(ranges=blocks_pb2.BlockRanges(ranges=[blocks_pb2.BlockRange(**r)
                                                                      for r in form["ranges"]]))
    if "packed" in form:
        packed = blocks_pb2.PackedIds(ids=base64.b64decode(form["packed"]))
        for name in ("count", "stride"):
            if form.get(name) is not None:
                setattr(packed, name, form[name])
        return blocks_pb2.Blocks(packed=packed)
    return blocks_pb2.Blocks(spread=blocks_pb2.SpreadIds(ids=form["ids"], count=form["count"], stride=form["stride"]))


def blocks_form(message: blocks_pb2.Blocks) -> list[int] | dict[str, Any] | None:
    """A message as the REST API's block-list form, for the same validation; None if unset."""
    which = message.WhichOneof("form")
    if which == "ids":
        return list(message.ids.ids)
    if which == "ranges":
        return {"ranges": [{"start": r.start, "count": r.count, **({"stride": r.stride} if r.HasField("stride") else {})}
                           for r in message.ranges.ranges]}
    if which == "spread":
        return {"ids": list(message.spread.ids), "count": message.spread.count, "stride": message.spread.stride}
    if which == "packed":
        form: dict[str, Any] = {"packed": base64.b64encode(message.packed.ids).decode()}
        for name in ("count", "stride"):
            if message.packed.HasField(name):
                form[name] = getattr(message.packed, name)
        return form
    return None


def region_message(description: Mapping[str, Any]) -> regions_pb2.Region:
    """A region's description (``Region.describe()``) as a message."""
    message = regions_pb2.Region(
        name=description["name"], kind=description["kind"], num_blocks=description["num_blocks"],
        block_shape=description["block_shape"], dtype=description["dtype"], device=description["device"],
        block_bytes=description["block_bytes"], busy_transfers=description["busy_transfers"],
        axes=description["axes"] or [], memory=description["memory"])
    if description.get("quarantined") is not None:
        message.quarantined = description["quarantined"]
    return message


def region_record(message: regions_pb2.Region) -> dict[str, Any]:
    """A message as the REST API's region JSON (less what codecs learned)."""
    return {"name": message.name, "kind": message.kind, "num_blocks": message.num_blocks,
            "block_shape": list(message.block_shape), "dtype": message.dtype, "device": message.device,
            "block_bytes": message.block_bytes, "busy_transfers": list(message.busy_transfers),
            "axes": list(message.axes) or None, "memory": message.memory,
            "quarantined": message.quarantined if message.HasField("quarantined") else None}
