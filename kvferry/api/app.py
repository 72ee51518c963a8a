"""The control API: ``create_app`` wires the routers; the sidecar engine lives on ``app.state``,
created in the lifespan. Handlers validate and delegate; one exception handler maps the
service's errors to HTTP statuses with a JSON body."""

from __future__ import annotations

import logging
import re
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, field_validator

from kvferry import codec
import torch

from kvferry.engine.errors import BadRequest, Conflict, NotFound, PayloadTooLarge, ServiceError, Unauthorized
from kvferry.engine.regions import DTYPES
from kvferry.engine.settings import Settings
from kvferry.engine.engine import Sidecar

log = logging.getLogger("kvferry.service")
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_BLOCKS = 1 << 20


class RegionSpec(BaseModel):
    name: str = Field(pattern=NAME)
    kind: Literal["owned", "shm", "cuda_ipc"] = "owned"
    num_blocks: int = Field(gt=0, le=MAX_BLOCKS)
    block_shape: list[Annotated[int, Field(gt=0)]] = Field(min_length=1, max_length=7)
    dtype: Literal["bfloat16", "float16", "float8_e5m2", "float8_e4m3fn"]
    shm_name: str | None = Field(default=None, description="kind=shm: POSIX shared-memory name")
    ipc_handle: str | None = Field(default=None, description="kind=cuda_ipc: base64 cudaIpcMemHandle")
    device: int | None = Field(default=None, description="kind=cuda_ipc: CUDA device index")
    offset: int = Field(default=0, ge=0, description="kind=cuda_ipc: byte offset into the allocation")


class TransferRequest(BaseModel):
    src_region: str = Field(pattern=NAME)
    src_blocks: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BLOCKS)
    peer: str = Field(description="the receiving sidecar's control URL, e.g. http://decode-0:7700")
    dst_region: str = Field(pattern=NAME)
    dst_blocks: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BLOCKS)
    codec: Literal["auto", "splitzip", "raw"] = "auto"
    codebook: str | None = Field(default=None, pattern=NAME)

    @field_validator("peer")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError("peer must be an http(s) URL with no path")
        return value


class IncomingRequest(BaseModel):
    """Sent by a peer sidecar to announce a transfer (internal)."""

    id: str = Field(pattern=r"^[0-9a-zA-Z_-]{1,64}$")
    secret: str = Field(min_length=16, max_length=128)
    dst_region: str = Field(pattern=NAME)
    dst_blocks: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BLOCKS)
    dtype: str
    block_shape: list[int]
    codec: Literal["splitzip", "raw"]
    chunks: list[Annotated[int, Field(gt=0)]] = Field(min_length=1)


class CalibrateRequest(BaseModel):
    region: str = Field(pattern=NAME)
    blocks: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BLOCKS)


def sidecar(request: Request) -> Sidecar:
    return request.app.state.sidecar


def authorized(request: Request) -> None:
    token = request.app.state.settings.token
    if token and request.headers.get("authorization") != f"Bearer {token}":
        raise Unauthorized("missing or wrong bearer token")


health = APIRouter(tags=["health"])
regions = APIRouter(prefix="/v1/regions", tags=["regions"], dependencies=[Depends(authorized)])
transfers = APIRouter(prefix="/v1", tags=["transfers"], dependencies=[Depends(authorized)])
codebooks = APIRouter(prefix="/v1/codebooks", tags=["codebooks"], dependencies=[Depends(authorized)])
SidecarDep = Annotated[Sidecar, Depends(sidecar)]


@health.get("/healthz")
async def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


@health.get("/readyz")
async def readyz(sc: SidecarDep) -> Response:
    """Ready once the data listener is up and the codec measured."""
    if not sc.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ready", "backend": sc.backend, "data_port": sc.listener.port})


@health.get("/metrics")
async def metrics(sc: SidecarDep) -> Response:
    """Prometheus exposition."""
    sc.refresh_gauges()
    return Response(generate_latest(sc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@regions.post("", status_code=201)
async def create_region(spec: RegionSpec, sc: SidecarDep) -> dict:
    """Register KV memory: ``owned`` (allocated here), ``shm`` or ``cuda_ipc`` (the worker's)."""
    if spec.kind == "shm" and not spec.shm_name:
        raise BadRequest("kind=shm needs shm_name")
    if spec.kind == "cuda_ipc" and not spec.ipc_handle:
        raise BadRequest("kind=cuda_ipc needs ipc_handle")
    return sc.regions.register(spec.model_dump()).describe()


@regions.get("")
async def list_regions(sc: SidecarDep) -> list[dict]:
    return [r.describe() for r in sc.regions.all()]


@regions.get("/{name}")
async def get_region(name: str, sc: SidecarDep) -> dict:
    return sc.regions.get(name).describe()


@regions.delete("/{name}", status_code=204)
async def delete_region(name: str, sc: SidecarDep) -> Response:
    sc.regions.delete(name)
    return Response(status_code=204)


@regions.put("/{name}/blocks/{index}", status_code=204)
async def put_block(name: str, index: int, request: Request, sc: SidecarDep) -> Response:
    """Overwrite one block with its raw bytes (application/octet-stream)."""
    region = sc.regions.get(name)
    region.check_blocks([index])
    body = await request.body()
    if len(body) != region.block_bytes:
        raise BadRequest(f"block {index} of {name!r} is {region.block_bytes} bytes, got {len(body)}")
    if region.busy:
        raise Conflict(f"region {name!r} is in use by a transfer")
    bits = codec.layout_by_name(region.dtype).int_dtype
    block = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(bits).view(region.block_shape)
    region.tensor.view(bits)[index].copy_(block)
    return Response(status_code=204)


@regions.get("/{name}/blocks/{index}")
async def get_block(name: str, index: int, sc: SidecarDep) -> Response:
    """One block's raw bytes."""
    region = sc.regions.get(name)
    region.check_blocks([index])
    data = region.tensor[index].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return Response(data, media_type="application/octet-stream")


@transfers.post("/transfers", status_code=202)
async def submit(body: TransferRequest, sc: SidecarDep) -> dict:
    """Send blocks of a local region to a peer sidecar's region; returns at once."""
    t = sc.submit(body.model_dump())
    return {"id": t.id, "state": t.state.value}


@transfers.get("/transfers")
async def list_transfers(sc: SidecarDep, state: Literal["queued", "running", "done", "failed", "cancelled"] | None = None,
                         direction: Literal["in", "out"] | None = None) -> list[dict]:
    return [t.public() for t in sc.transfers.query(state, direction)]


@transfers.get("/transfers/{transfer_id}")
async def get_transfer(transfer_id: str, sc: SidecarDep,
                       wait: Annotated[float, Query(ge=0, le=300)] = 0) -> dict:
    """A transfer's state; ``wait`` long-polls up to that many seconds for a terminal state."""
    t = sc.transfers.get(transfer_id)
    if wait:
        await t.wait(wait)
    return t.public()


@transfers.delete("/transfers/{transfer_id}")
async def cancel(transfer_id: str, sc: SidecarDep) -> dict:
    """Cancel a queued or running transfer (either side; the other side is told)."""
    return sc.cancel(transfer_id).public()


@transfers.post("/incoming", include_in_schema=True, tags=["peer"])
async def incoming(body: IncomingRequest, request: Request, sc: SidecarDep) -> dict:
    """Peer-to-peer: a sending sidecar announces a transfer; answers with the data address."""
    return sc.accept_incoming(body.model_dump(), request.client.host if request.client else None)


@codebooks.put("/{name}")
async def put_codebook(name: str, request: Request, sc: SidecarDep) -> dict:
    """Store a codebook (the JSON of ``codec.Codebook.to_json``)."""
    if not re.match(NAME, name):
        raise BadRequest("bad codebook name")
    try:
        book = codec.Codebook.from_json(await request.body())
    except codec.CodecError as exc:
        raise BadRequest(str(exc)) from exc
    sc.codebooks[name] = book
    return {"name": name, **_book(book)}


@codebooks.get("/{name}")
async def get_codebook(name: str, sc: SidecarDep) -> Response:
    if name not in sc.codebooks:
        raise NotFound(f"no codebook named {name!r}")
    return Response(sc.codebooks[name].to_json(), media_type="application/json")


@codebooks.post("/{name}/calibrate")
async def calibrate(name: str, body: CalibrateRequest, sc: SidecarDep) -> dict:
    """Calibrate a codebook on blocks of a region and store it under ``name``."""
    region = sc.regions.get(body.region)
    ids = region.check_blocks(body.blocks)
    bits = codec.layout_by_name(region.dtype).int_dtype  # index_select lacks some float8 kernels
    book = codec.calibrate(region.tensor.view(bits).index_select(0, ids).view(DTYPES[region.dtype]))
    sc.codebooks[name] = book
    return {"name": name, **_book(book)}


def _book(book: codec.Codebook) -> dict:
    return {"dtype": book.dtype, "exponents": list(book.exponents), "coverage": book.coverage, "samples": book.samples}


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sc = Sidecar(settings)
        app.state.sidecar = sc
        await sc.start()
        try:
            yield
        finally:
            await sc.close()

    app = FastAPI(title="kvferry sidecar", version="0.1.0", lifespan=lifespan,
                  description="Lossless compressed KV-cache transfer between GPU workers.")
    app.state.settings = settings
    for router in (health, regions, transfers, codebooks):
        app.include_router(router)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": "BadRequest", "detail": _plain(exc.errors())}, status_code=422)

    return app


class BodyLimit:
    """Refuses a request whose declared body is over ``max_bytes`` before reading any of it.

    Plain ASGI rather than ``@app.middleware("http")``, which wraps every request and response
    in extra tasks and streams: that cost a millisecond per call, on every transfer's announce.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                await _error(PayloadTooLarge(f"request body over {self.max_bytes} bytes"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(exc: ServiceError) -> JSONResponse:
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=exc.status)


def _plain(errors) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors)
