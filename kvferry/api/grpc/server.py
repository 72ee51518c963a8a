"""The gRPC control plane beside REST: a ``grpc.aio`` server on the REST app's event loop and
engine (``settings.grpc_port``, on ``settings.host``), with the REST API's token as call
credentials (``authorization: Bearer <token>``), the standard health service (SERVING once the
engine is ready) and server reflection; both of these answer without the token, like ``/readyz``
and ``/openapi.json``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2 as std_health_pb2
from grpc_health.v1 import health_pb2_grpc as std_health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvferry.engine.engine import Engine
from kvferry.engine.errors import Unauthorized
from kvferry.engine.settings import Settings
from kvferry.proto.v1 import (codebooks_pb2, codebooks_pb2_grpc, health_pb2, health_pb2_grpc, regions_pb2,
                              regions_pb2_grpc, transfers_pb2, transfers_pb2_grpc)

from ..auth import token_ok
from .services import Codebooks, Health, Regions, Transfers, abort
from .watch import Hub

log = logging.getLogger("kvferry.api")
SERVICES = tuple(module.DESCRIPTOR.services_by_name[name].full_name for module, name in (
    (regions_pb2, "RegionsService"), (transfers_pb2, "TransfersService"), (codebooks_pb2, "CodebooksService"),
    (health_pb2, "HealthService")))
PUBLIC = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
          "/grpc.reflection.v1.ServerReflection/")
GRACE = 5.0  # seconds calls in flight get at shutdown


class Auth(grpc.aio.ServerInterceptor):
    """The token on every call but the public services' (checked in constant time), and the
    engine's loop kept hot for the next call, as the REST Guard does."""

    def __init__(self, token: str, engine: Engine):
        self.token, self.engine = token, engine

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        self.engine.spinner.touch()
        handler = await continuation(details)
        if handler is None or not self.token or details.method.startswith(PUBLIC):
            return handler
        supplied = dict(details.invocation_metadata or ()).get("authorization", "")
        if token_ok(supplied if isinstance(supplied, str) else supplied.decode("latin-1"), self.token):
            return handler
        denied = Unauthorized("missing or wrong bearer token (metadata authorization: Bearer <token>)")
        if handler.unary_stream is not None:
            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await abort(context, denied)
                yield  # an async generator, as the stream's handler must be
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await abort(context, denied)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


class ControlPlane:
    """The running gRPC server of one engine."""

    def __init__(self, engine: Engine, settings: Settings):
        self.hub = Hub(engine.transfers)
        self.health = HealthServicer()
        self.server = grpc.aio.server(interceptors=[Auth(settings.token, engine)], options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes), ("grpc.so_reuseport", 0)])
        regions_pb2_grpc.add_RegionsServiceServicer_to_server(Regions(engine), self.server)
        transfers_pb2_grpc.add_TransfersServiceServicer_to_server(Transfers(engine, self.hub), self.server)
        codebooks_pb2_grpc.add_CodebooksServiceServicer_to_server(Codebooks(engine), self.server)
        health_pb2_grpc.add_HealthServiceServicer_to_server(Health(engine), self.server)
        std_health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*SERVICES, std_health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME), self.server)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        self.port = self.server.add_insecure_port(f"{host}:{settings.grpc_port}")
        if not self.port:
            raise OSError(f"gRPC cannot listen on {host}:{settings.grpc_port}")

    async def start(self, ready: bool) -> None:
        await self.server.start()
        status = std_health_pb2.HealthCheckResponse.SERVING if ready else std_health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *SERVICES):
            await self.health.set(service, status)
        log.info("gRPC control plane on port %d", self.port)

    async def stop(self) -> None:
        """Health says NOT_SERVING, Watch streams end (UNAVAILABLE: clients watch again elsewhere or
        later), calls in flight get ``GRACE`` seconds."""
        await self.health.enter_graceful_shutdown()
        self.hub.close()
        await self.server.stop(GRACE)
