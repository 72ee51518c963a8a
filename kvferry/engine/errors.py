"""The service's exception tree; one handler maps each class to an HTTP status with a JSON body
``{"error": <class name>, "detail": <message>}``, and the client SDK raises the same classes back.

    ServiceError (500)
    ├── BadRequest (400)         malformed or inconsistent input
    │   └── InvalidBlocks (400)  block ids out of range, repeated, or of the wrong count
    ├── Unauthorized (401)       missing or wrong bearer token / transfer secret
    ├── NotFound (404)           no such region, transfer or codebook
    ├── Conflict (409)           name already taken, region busy, transfer already finished
    ├── PayloadTooLarge (413)    request body above the configured limit
    ├── Overloaded (429)         too many concurrent transfers
    └── PeerError (502)          the peer sidecar refused or failed a request
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 500


class BadRequest(ServiceError):
    status = 400


class InvalidBlocks(BadRequest):
    pass


class Unauthorized(ServiceError):
    status = 401


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class PayloadTooLarge(ServiceError):
    status = 413


class Overloaded(ServiceError):
    status = 429


class PeerError(ServiceError):
    status = 502


BY_NAME = {cls.__name__: cls for cls in (ServiceError, BadRequest, InvalidBlocks, Unauthorized, NotFound,
                                          Conflict, PayloadTooLarge, Overloaded, PeerError)}
