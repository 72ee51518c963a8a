"""Engine error class → HTTP status and gRPC status code: the one place for both front ends.
REST's body is ``{"error": <class name>, "detail": <message>}``; gRPC sends the class name in the
trailing metadata (``kvferry-error``). Either way the client SDK raises the same class back."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvferry.engine import errors

# class: (HTTP status, gRPC status code name). Conflict is FAILED_PRECONDITION (a name taken, a
# region busy, a transfer that has ended: the state, not the request, is wrong); a transfer that
# failed while the call waited for it is ABORTED; too many transfers (429) is RESOURCE_EXHAUSTED,
# as gRPC's HTTP mapping has it.
STATUS: dict[type[errors.EngineError], tuple[int, str]] = {
    errors.BadRequest: (400, "INVALID_ARGUMENT"),
    errors.Unauthorized: (401, "UNAUTHENTICATED"),
    errors.NotFound: (404, "NOT_FOUND"),
    errors.Conflict: (409, "FAILED_PRECONDITION"),
    errors.RegionMemoryGone: (409, "FAILED_PRECONDITION"),
    errors.TransferFailed: (409, "ABORTED"),
    errors.PayloadTooLarge: (413, "RESOURCE_EXHAUSTED"),
    errors.InsufficientStorage: (507, "RESOURCE_EXHAUSTED"),
    errors.Overloaded: (429, "RESOURCE_EXHAUSTED"),
    errors.PeerError: (502, "UNAVAILABLE"),
    errors.EngineError: (500, "INTERNAL"),
}


# Statuses Starlette raises itself (a body that is not JSON, an unknown path or method), named in
# the same body shape so that every error the API answers matches its documented model.
STARLETTE_NAMES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed",
                   413: "PayloadTooLarge"}


def _statuses(exc: errors.EngineError) -> tuple[int, str]:
    for cls in type(exc).__mro__:  # the most specific class that has a status
        if cls in STATUS:
            return STATUS[cls]
    return STATUS[errors.EngineError]


def status_of(exc: errors.EngineError) -> int:
    """The HTTP status of ``exc``."""
    return _statuses(exc)[0]


def grpc_code_of(exc: errors.EngineError) -> str:
    """The gRPC status code name (``grpc.StatusCode[name]``) of ``exc``."""
    return _statuses(exc)[1]


def details(exc: errors.EngineError) -> dict[str, str]:
    """What the client needs to raise ``exc`` back: its class, and a failed transfer's state and kind."""
    body = {"error": type(exc).__name__}
    if isinstance(exc, errors.TransferFailed):
        body["state"] = exc.state
        if exc.kind is not None:
            body["kind"] = exc.kind
    return body


def response(exc: errors.EngineError) -> JSONResponse:
    return JSONResponse({**details(exc), "detail": str(exc)}, status_code=status_of(exc))


def http_response(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Starlette's own HTTP errors in the error model."""
    return JSONResponse({"error": STARLETTE_NAMES.get(status, "HTTPError"), "detail": detail}, status_code=status,
                        headers=headers)


def plain(validation_errors: list[dict]) -> str:
    """Pydantic's validation errors in one line: ``field.path: message; ...``."""
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in validation_errors)
