"""Request models of the REST API, separate from the engine's own types (``to_spec`` converts)."""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from kvferry.engine.blocks import MAX_BLOCKS, Blocks, Range

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")


class RegionBody(BaseModel):
    name: str = Field(pattern=NAME)
    kind: Literal["owned", "shm", "cuda_ipc"] = "owned"
    num_blocks: StrictInt = Field(gt=0, le=MAX_BLOCKS)
    block_shape: list[Annotated[StrictInt, Field(gt=0, le=1 << 31)]] = Field(min_length=1, max_length=7)
    dtype: Literal["bfloat16", "float16", "float8_e5m2", "float8_e4m3fn"]
    axes: list[Annotated[str, Field(max_length=32)]] | None = Field(
        default=None, description="names of the block dimensions, e.g. [token, head, channel]")
    shm_name: str | None = Field(default=None, max_length=250, description="kind=shm: POSIX shared-memory name")
    ipc_handle: str | None = Field(default=None, max_length=512, description="kind=cuda_ipc: base64 cudaIpcMemHandle")
    device: int | None = Field(default=None, ge=0, description="kind=cuda_ipc: CUDA device index")
    offset: int = Field(default=0, ge=0, le=1 << 62, description="kind=cuda_ipc: byte offset into the allocation")


def _nonzero(value: int) -> int:
    if value == 0:
        raise ValueError("stride must not be 0")
    return value


Stride = Annotated[StrictInt, Field(gt=-2 ** 31, lt=2 ** 31), AfterValidator(_nonzero)]  # the wire's i32


class RangeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: StrictInt = Field(ge=0, lt=2 ** 32)  # the peer protocol's fields (peer.py)
    count: StrictInt = Field(gt=0, le=MAX_BLOCKS)
    stride: Stride = 1


class RangesBody(BaseModel):
    ranges: list[RangeBody] = Field(min_length=1, max_length=4096)


BlockId = Annotated[StrictInt, Field(ge=0, lt=1 << 32)]  # true and "1" are not block ids


class SpreadBody(BaseModel):
    """Each id ``b`` stands for ``b, b + stride, ...``, ``count`` of them (a vLLM block across a
    cache's layers and K/V)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[BlockId] = Field(min_length=1, max_length=MAX_BLOCKS)
    count: StrictInt = Field(gt=0, le=MAX_BLOCKS)
    stride: Stride


def _unpack_ids(text: str) -> tuple[int, ...]:
    """Base64 of little-endian u32 ids, as a tuple."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("packed ids are not base64") from None
    if not raw or len(raw) % 4 or len(raw) > 4 * MAX_BLOCKS:
        raise ValueError(f"packed ids are 1 to {MAX_BLOCKS} little-endian u32 (a multiple of 4 bytes), not {len(raw)} bytes")
    return struct.unpack(f"<{len(raw) // 4}I", raw)


class PackedBody(BaseModel):
    """Block ids as one base64 string of little-endian u32 (``kvferry.client.packed``): an engine's
    thousands of ids a request without a JSON number each to write and validate. With ``count``
    and ``stride``, each id is spread as in the ``{ids, count, stride}`` form."""

    model_config = ConfigDict(extra="forbid")

    packed: Annotated[str, Field(min_length=1, max_length=(4 * MAX_BLOCKS + 2) // 3 * 4), AfterValidator(_unpack_ids)]
    count: StrictInt = Field(default=1, gt=0, le=MAX_BLOCKS)
    stride: Stride | None = None

    @model_validator(mode="after")
    def _spread(self) -> PackedBody:
        if self.count > 1 and self.stride is None:
            raise ValueError("a spread (count > 1) needs a stride")
        return self


# Tried in order, the packed form first: an engine's form, and trying it costs a failed dict check.
BlockList = Annotated[PackedBody | SpreadBody | RangesBody | list[BlockId], Field(union_mode="left_to_right")]


def to_blocks(value: BlockList) -> Blocks:
    if isinstance(value, PackedBody):
        ids: tuple[int, ...] = value.packed  # decoded by its validator
        return Blocks(ids=ids, spread=(value.count, value.stride) if value.stride is not None else None)
    if isinstance(value, SpreadBody):
        return Blocks(ids=tuple(value.ids), spread=(value.count, value.stride))
    if isinstance(value, RangesBody):
        return Blocks(ranges=tuple(Range(r.start, r.count, r.stride) for r in value.ranges))
    return Blocks(ids=tuple(value))


CODEC = r"^[a-z0-9_-]{1,32}$"
REFERENCE = "region holding a predictor's KV for the same blocks (codec=predictive), on the"


class PairBody(BaseModel):
    src: str = Field(pattern=NAME)
    dst: str = Field(pattern=NAME)
    src_reference: str | None = Field(default=None, pattern=NAME, description=f"{REFERENCE} sender")
    dst_reference: str | None = Field(default=None, pattern=NAME, description=f"{REFERENCE} receiver")

    @model_validator(mode="after")
    def _both_references(self) -> PairBody:
        if (self.src_reference is None) != (self.dst_reference is None):
            raise ValueError("src_reference and dst_reference go together")
        return self


class TransferBody(BaseModel):
    """Send the same blocks of one region (``src_region``/``dst_region``) or of several
    (``regions``: source/destination pairs, e.g. every layer) to a peer sidecar."""

    peer: str = Field(description="the receiving sidecar's data address, host:port (its /v1/health data_address)")
    src_region: str | None = Field(default=None, pattern=NAME)
    dst_region: str | None = Field(default=None, pattern=NAME)
    regions: list[PairBody] | None = Field(default=None, min_length=1, max_length=4096)
    src_blocks: BlockList = Field(description="block ids, {ranges: [{start, count, stride}]}, {ids, count, "
                                              "stride}: each id spread over count ids stride apart, or {packed, "
                                              "count?, stride?}: the ids as base64 of little-endian u32")
    dst_blocks: BlockList
    codec: str = Field(default="auto", pattern=CODEC,
                       description="auto (lossless, chosen per transfer) or a registered codec; lossy codecs "
                                   "(k8v4, k4v2, lowrank) only when named")
    codebook: str | None = Field(default=None, pattern=NAME)
    id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$",
                           description="the transfer's id, chosen by the submitter (32 hex digits; 409 if taken): "
                                       "a receiver can be asked for it before this call answers")
    src_reference: str | None = Field(default=None, pattern=NAME, description=f"{REFERENCE} sender")
    dst_reference: str | None = Field(default=None, pattern=NAME, description=f"{REFERENCE} receiver")

    @field_validator("peer")
    @classmethod
    def _address(cls, value: str) -> str:
        if not ADDRESS.match(value):
            raise ValueError("peer must be host:port of the receiving sidecar's data listener")
        return value

    @field_validator("src_blocks", "dst_blocks")
    @classmethod
    def _size(cls, value: BlockList) -> BlockList:
        if isinstance(value, list) and not 0 < len(value) <= MAX_BLOCKS:
            raise ValueError(f"between 1 and {MAX_BLOCKS} block ids")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> TransferBody:
        single = self.src_region is not None or self.dst_region is not None
        if single == (self.regions is not None):
            raise ValueError("give src_region and dst_region, or regions, not both")
        if single and (self.src_region is None or self.dst_region is None):
            raise ValueError("src_region and dst_region go together")
        if (self.src_reference is None) != (self.dst_reference is None):
            raise ValueError("src_reference and dst_reference go together")
        if not single and self.src_reference is not None:
            raise ValueError("with regions, give each pair its references")
        if self.regions is not None and len({p.src_reference is None for p in self.regions}) > 1:
            raise ValueError("give references for every pair or for none")
        return self

    def pairs(self) -> tuple[tuple[str, str], ...]:
        if self.regions is not None:
            return tuple((p.src, p.dst) for p in self.regions)
        return ((self.src_region, self.dst_region),)

    def references(self) -> tuple[tuple[str, str], ...] | None:
        if self.regions is not None:
            refs = tuple((p.src_reference, p.dst_reference) for p in self.regions)
            return refs if refs[0][0] is not None else None
        return None if self.src_reference is None else ((self.src_reference, self.dst_reference),)


class CalibrateBody(BaseModel):
    region: str = Field(pattern=NAME)
    blocks: BlockList
    codec: str = Field(default="splitzip", pattern=CODEC)
    token_axis: int | None = Field(default=None, ge=0, le=6, description="block dimension that is the token axis")
    options: dict[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")], float | int | str | None] = Field(
        default_factory=dict, max_length=16,
        description="the codec's calibration options, e.g. lowrank: {energy: 0.99} or {rank_budget: 4096}")


class ErrorBody(BaseModel):
    """Every error's body: the engine's error class and what went wrong."""

    error: str = Field(description="the error class, e.g. NotFound; the client SDK raises the same class")
    detail: str
    state: str | None = Field(default=None, description="TransferFailed only: failed or cancelled")


ERRORS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (400, "malformed or inconsistent input"), (401, "missing or wrong bearer token"),
    (404, "no such region, transfer or codebook"), (409, "conflict (a region's memory truncated: RegionMemoryGone), or the transfer failed (TransferFailed)"),
    (413, "body or region above its limit"), (422, "request does not match its schema"),
    (429, "too many transfers in progress (retry)"), (502, "the peer sidecar refused or failed"),
    (507, "no memory free for an owned region now (InsufficientStorage)"))}
