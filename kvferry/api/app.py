"""The REST front end: ``create_app`` wires the routers; the engine lives on ``app.state``, created
in the lifespan. Handlers validate and delegate; one exception handler maps the engine's errors to
statuses (``errors.py``)."""

from __future__ import annotations

import logging
import math
import re
from contextlib import asynccontextmanager
from typing import Annotated, Literal
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvferry import __version__
from kvferry.engine.engine import MAX_DRAIN_S, Engine
from kvferry.engine.errors import EngineError, PayloadTooLarge, Unauthorized
from kvferry.engine.settings import Settings

from . import errors, ops
from .auth import token_ok
from .leases import MAX_WAIT, LeaseBody, LeaseBook, RenewBody
from .models import CODEC, ERRORS, NAME, CalibrateBody, RegionBody, TransferBody
from .ops import MAX_APPEAR, submit_transfer, transfer_record

log = logging.getLogger("kvferry.api")


async def engine(request: Request) -> Engine:
    """The app's engine (``async``: FastAPI runs a plain ``def`` dependency on a worker thread,
    ~0.1 ms a call)."""
    return request.app.state.engine


bearer = HTTPBearer(auto_error=False, description="the sidecar's token (KVFERRY_TOKEN)")


async def authorized(request: Request,
                     _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None) -> None:
    """The token, checked again where a route declares it (``Guard`` checked it before the body)."""
    token = request.app.state.settings.token
    if token and not token_ok(request.headers.get("authorization", ""), token):
        raise Unauthorized("missing or wrong bearer token")


EngineDep = Annotated[Engine, Depends(engine)]
health = APIRouter(tags=["health"])
regions = APIRouter(prefix="/v1/regions", tags=["regions"], dependencies=[Depends(authorized)], responses=ERRORS)
transfers = APIRouter(prefix="/v1/transfers", tags=["transfers"], dependencies=[Depends(authorized)], responses=ERRORS)
leases = APIRouter(prefix="/v1/leases", tags=["leases"], dependencies=[Depends(authorized)], responses=ERRORS)
codebooks = APIRouter(prefix="/v1/codebooks", tags=["codebooks"], dependencies=[Depends(authorized)], responses=ERRORS)


@health.get("/healthz")
async def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


@health.get("/readyz")
async def readyz(e: EngineDep) -> Response:
    """Ready once the data listener is up and the codecs measured."""
    if not e.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ready", "backend": e.backend, "data_address": e.data_address})


@health.get("/v1/health", dependencies=[Depends(authorized)], responses={401: ERRORS[401]})
async def health_v1(e: EngineDep) -> dict:
    """What a peer needs to send here (``data_address``), and what this sidecar runs; ``grpc_port``
    (0: off) tells a vLLM decode where to watch its transfers."""
    return {**ops.health(e), "grpc_port": e.settings.grpc_port}


@health.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {}}}})
@health.get("/v1/metrics", include_in_schema=False)
async def metrics(e: EngineDep) -> Response:
    """Prometheus exposition."""
    e.refresh_gauges()
    return Response(generate_latest(e.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@regions.post("", status_code=201)
async def create_region(body: RegionBody, e: EngineDep) -> dict:
    """Register KV memory: ``owned`` (allocated here), ``shm`` or ``cuda_ipc`` (the worker's)."""
    return await ops.create_region(e, body)


@regions.get("")
async def list_regions(e: EngineDep) -> list[dict]:
    return [r.describe() for r in e.regions.all()]


@regions.get("/{name}")
async def get_region(name: str, e: EngineDep) -> dict:
    return e.regions.get(name).describe()


@regions.delete("/{name}", status_code=204)
async def delete_region(name: str, e: EngineDep, force: bool = False,
                        drain: Annotated[float, Query(ge=0, le=MAX_DRAIN_S,
                                                      description="seconds to wait for transfers to end")] = 0.0
                        ) -> Response:
    """409 while a transfer in progress uses it, or while it is quarantined (a sender did not
    confirm giving back its lease: ``force=true`` deletes it anyway). Work of an ended transfer
    that still reads or writes it is waited for, up to the close timeout. ``drain``: seconds to
    wait for the transfers in progress to end, new ones refused (409) meanwhile."""
    await e.delete_region(name, force, drain)  # its lease, if any, ends with it (``LeaseBook.start``)
    return Response(status_code=204)


@leases.put("/{name}")
async def take_lease(name: Annotated[str, Path(pattern=NAME)], body: LeaseBody, e: EngineDep, request: Request) -> dict:
    """Lease region ``name``: deleted ``seconds`` from now unless renewed, and ``ttl`` seconds
    after it was taken at the latest (``docs/decisions/023-connector-leases.md``). With ``of``,
    ``name`` is first created as a view of region ``of`` (one call per lease of a worker's cache)."""
    return request.app.state.leases.take(e, name, body.seconds, body.ttl, body.of)


@leases.post("/renew")
async def renew_leases(body: RenewBody, request: Request) -> dict:
    """Heartbeat: extend the named leases (those gone are answered ``missing``)."""
    return request.app.state.leases.renew(body.names, body.seconds)


@leases.get("")
async def list_leases(request: Request, after: int = -1,
                      wait: Annotated[float, Query(ge=0, le=MAX_WAIT)] = 0.0) -> dict:
    """The leases and the book's generation; with ``wait``, answered once the generation passed
    ``after`` (a lease taken or ended) or after ``wait`` seconds: a long-poll."""
    return await request.app.state.leases.changes(after, wait)


@regions.put("/{name}/blocks/{index}", status_code=204)
async def put_block(name: str, index: int, request: Request, e: EngineDep) -> Response:
    """Overwrite one block with its raw bytes (application/octet-stream)."""
    e.write_block(name, index, await request.body())
    return Response(status_code=204)


@regions.put("/{name}/blocks", status_code=204)
async def put_blocks(name: str, request: Request, e: EngineDep,
                     start: Annotated[int, Query(ge=0, description="the first block to overwrite")],
                     count: Annotated[int, Query(ge=1, description="how many blocks the body holds")]) -> Response:
    """Overwrite blocks ``start`` to ``start + count - 1`` with their raw bytes, concatenated
    (application/octet-stream; at most ``max_body_bytes``): an upload in as few requests as
    the body limit allows, rather than one per block."""
    ops.write_blocks(e, name, start, count, await request.body())
    return Response(status_code=204)


@regions.get("/{name}/blocks/{index}", response_class=Response, responses={200: {
    "description": "the block's raw bytes", "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                                "format": "binary"}}}}})
async def get_block(name: str, index: int, e: EngineDep) -> Response:
    """One block's raw bytes."""
    return Response(e.read_block(name, index), media_type="application/octet-stream")


@transfers.post("", status_code=202)
async def submit(body: TransferBody, e: EngineDep,
                 wait: Annotated[float, Query(ge=0, le=300, description="answer once done, up to this long")] = 0
                 ) -> Response:
    """Send blocks of local regions to a peer sidecar's regions; returns at once, or with ``wait``
    once the transfer is done (200) or failed (409, with the reason)."""
    return JSONResponse(*await submit_transfer(e, body, wait))


@transfers.get("")
async def list_transfers(e: EngineDep, state: Literal["queued", "running", "done", "failed", "cancelled"] | None = None,
                         direction: Literal["in", "out"] | None = None,
                         limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> list[dict]:
    """Newest first."""
    return [t.public() for t in e.transfers.query(state, direction, limit)]


@transfers.get("/{transfer_id}")
async def get_transfer(transfer_id: str, e: EngineDep,
                       wait: Annotated[float, Query(ge=0, le=300)] = 0,
                       appear: Annotated[float, Query(ge=0, le=MAX_APPEAR)] = 0) -> dict:
    """A transfer's state; ``wait`` long-polls up to that many seconds for a terminal state, and
    ``appear`` first waits up to that long (within ``wait``) for a transfer a peer is about to
    announce here (a decode waiting on its own sidecar for the KV it asked a prefill for)."""
    return await transfer_record(e, transfer_id, wait, appear)


@transfers.delete("/{transfer_id}")
async def cancel(transfer_id: str, e: EngineDep) -> dict:
    """Cancel a running transfer (either side; the other side is told). Answers once nothing of
    it runs any more, also where it had ended already (409)."""
    return await ops.cancel_transfer(e, transfer_id)


@codebooks.put("/{name}")
async def put_codebook(name: str, request: Request, e: EngineDep,
                       codec_name: Annotated[str, Query(alias="codec", pattern=CODEC)] = "splitzip"
                       ) -> dict:
    """Store a codebook document (the codec's ``to_json``)."""
    return ops.put_codebook(e, name, codec_name, await request.body())


@codebooks.get("/{name}")
async def get_codebook(name: str, e: EngineDep) -> Response:
    return Response(e.codebook_json(name), media_type="application/json")


@codebooks.post("/{name}/calibrate")
async def calibrate(name: str, body: CalibrateBody, e: EngineDep) -> dict:
    """Calibrate a codebook for ``codec`` on blocks of a region and store it under ``name``."""
    return await ops.calibrate(e, name, body)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_access_log()
        e = Engine(settings)
        app.state.engine = e
        app.state.leases = LeaseBook()
        await e.start()
        app.state.leases.start(e)
        grpc_plane = None
        try:
            if settings.grpc_port:  # imported only here: grpcio is an extra
                from .grpc.server import ControlPlane

                grpc_plane = ControlPlane(e, settings)
                await grpc_plane.start(e.ready)
            yield
        finally:
            if grpc_plane is not None:
                await grpc_plane.stop()
            await app.state.leases.close()
            await e.close()

    # No Swagger UI or ReDoc: they load scripts from a CDN. The schema is at /openapi.json.
    app = FastAPI(title="kvferry sidecar", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Lossless compressed KV-cache transfer between GPU workers.")
    app.state.settings = settings
    app.state.http_requests = 0
    for router in (health, regions, leases, transfers, codebooks):
        app.include_router(router)
    app.add_middleware(Lane)
    app.add_middleware(Guard, max_bytes=settings.max_body_bytes, token=settings.token)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return errors.response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return errors.http_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": "BadRequest", "detail": errors.plain(exc.errors())}, status_code=422)

    return app


BLOCK_PATH = re.compile(r"^/v1/regions/[^/]+/blocks(/[^/]*)?$")


class AccessLog(logging.Filter):
    """uvicorn's access log without query strings (a client may put a secret in a URL, and the
    log must not keep it), and the block routes' lines at DEBUG: an upload is many of them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:  # client, method, path, version, status
            client, method, path, version, status = record.args
            path = str(path).split("?", 1)[0]  # the path itself is percent-encoded: its own "?" is "%3F"
            record.args = (client, method, path, version, status)
            if BLOCK_PATH.match(path) and record.levelno > logging.DEBUG:
                if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
                    return False
                record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def quiet_access_log() -> None:
    """Install ``AccessLog`` on uvicorn's access logger (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessLog) for f in logger.filters):
        logger.addFilter(AccessLog())


PUBLIC_PATHS = ("/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")


class Guard:
    """Before any handler reads a byte of the body: the token is checked (on every path but the
    public ones) and a body over ``max_bytes`` is refused — declared by Content-Length, or counted
    as it streams in (chunked), reading at most ``max_bytes`` + one message. It also counts requests
    (``kvferry_http_requests_total``: sidecars must not call each other) and keeps the engine's
    loop hot for the next one (``engine.spin``).

    Plain ASGI rather than ``@app.middleware("http")``, which wraps every request and response
    in extra tasks and streams: that cost a millisecond per call.
    """

    def __init__(self, app, max_bytes: int, token: str):
        self.app = app
        self.max_bytes = max_bytes
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        engine_ = getattr(scope["app"].state, "engine", None) if "app" in scope else None
        if engine_ is not None:
            engine_.metrics.http_requests.labels(scope["method"]).inc()
            engine_.spinner.touch()
        headers = dict(scope["headers"])
        if self.token and scope["path"] not in PUBLIC_PATHS and not token_ok(headers.get(b"authorization", b""),
                                                                               self.token):
            await errors.response(Unauthorized("missing or wrong bearer token"))(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await errors.response(PayloadTooLarge(f"request body over {self.max_bytes} bytes"))(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No declared length (chunked): read it here, up to the limit, then hand it on whole.
        try:
            body = await _read_body(receive, self.max_bytes)
        except PayloadTooLarge as exc:
            await errors.response(exc)(scope, receive, send)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)


class Lane:
    """The transfer routes an engine calls per request (``POST /v1/transfers``, ``GET
    /v1/transfers/{id}``), served before FastAPI's router by the same handlers: its routing,
    dependency solving and response wrappers cost ~0.5 ms a call here, more than the transfer of
    a block. Inside ``Guard`` (token and body size checked). Anything this lane does not take as
    it is (another content type, another query, a body the model refuses) goes on to FastAPI,
    which answers it as documented, validation errors included."""

    PREFIX = "/v1/transfers"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith(self.PREFIX):  # only these routes parse the query here
            method, query = scope["method"], _query(scope["query_string"])
            if query is not None and not query[1] and path == self.PREFIX and method == "POST" and _json(scope):
                await self._submit(scope, receive, send, query[0])
                return
            name = path[len(self.PREFIX) + 1:] if path.startswith(self.PREFIX + "/") else ""
            if query is not None and name and "/" not in name and method == "GET":
                await self._answer(scope, receive, send,
                                   transfer_record(scope["app"].state.engine, name, *query))
                return
        await self.app(scope, receive, send)

    async def _submit(self, scope, receive, send, wait: float) -> None:
        body = await _read_body(receive)  # Guard has bounded it
        if body is None:
            return
        try:
            model = TransferBody.model_validate_json(body)
        except ValidationError:  # FastAPI's own answer: the documented 422
            await self.app(scope, _replay(body, receive), send)
            return
        await self._answer(scope, receive, send, submit_transfer(scope["app"].state.engine, model, wait))

    @staticmethod
    async def _answer(scope, receive, send, work) -> None:
        try:
            result = await work
        except EngineError as exc:
            await errors.response(exc)(scope, receive, send)
            return
        content, status = result if isinstance(result, tuple) else (result, 200)
        await JSONResponse(content, status_code=status)(scope, receive, send)


def _query(query: bytes) -> tuple[float, float] | None:
    """(``wait``, ``appear``) of a query that holds nothing else, each valid as the routes
    declare it (0 to 300 and 0 to ``MAX_APPEAR`` seconds, at most once); None for any other query
    (FastAPI's to answer)."""
    values = {"wait": 0.0, "appear": 0.0}
    if not query:
        return 0.0, 0.0
    try:
        pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True, strict_parsing=True)
        for key, value in pairs:
            number = float(value)
            limit = MAX_APPEAR if key == "appear" else 300
            if key not in values or len(pairs) > len({k for k, _ in pairs}) or not (math.isfinite(number)
                                                                                    and 0 <= number <= limit):
                return None
            values[key] = number
    except ValueError:
        return None
    return values["wait"], values["appear"]


def _json(scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


async def _read_body(receive, limit: int | None = None) -> bytes | None:
    """The request's whole body, or None if the client went away.

    Raises:
        PayloadTooLarge: it grew past ``limit`` bytes (read up to one message beyond).
    """
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if limit is not None and size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` that hands on ``body`` (read already) as the request's whole body."""
    replayed = False

    async def again():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again
