"""Engine error class → HTTP status: the one place. The body is ``{"error": <class name>,
"detail": <message>}``, and the client SDK raises the same class back."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvferry.engine import errors

STATUS: dict[type[errors.EngineError], int] = {
    errors.BadRequest: 400,
    errors.Unauthorized: 401,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.RegionMemoryGone: 409,
    errors.TransferFailed: 409,
    errors.PayloadTooLarge: 413,
    errors.InsufficientStorage: 507,
    errors.Overloaded: 429,
    errors.PeerError: 502,
    errors.EngineError: 500,
}


# Statuses Starlette raises itself (a body that is not JSON, an unknown path or method), named in
# the same body shape so that every error the API answers matches its documented model.
STARLETTE_NAMES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed",
                   413: "PayloadTooLarge"}


def status_of(exc: errors.EngineError) -> int:
    for cls in type(exc).__mro__:  # the most specific class that has a status
        if cls in STATUS:
            return STATUS[cls]
    return 500


def response(exc: errors.EngineError) -> JSONResponse:
    body = {"error": type(exc).__name__, "detail": str(exc)}
    if isinstance(exc, errors.TransferFailed):
        body["state"] = exc.state
        body["kind"] = exc.kind
    return JSONResponse(body, status_code=status_of(exc))


def http_response(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Starlette's own HTTP errors in the error model."""
    return JSONResponse({"error": STARLETTE_NAMES.get(status, "HTTPError"), "detail": detail}, status_code=status,
                        headers=headers)
