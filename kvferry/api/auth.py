"""The bearer token both front ends check (REST's middleware, gRPC's interceptor)."""

from __future__ import annotations

import hmac


def token_ok(supplied: bytes | str, token: str) -> bool:
    """Constant-time comparison of an Authorization header with ``Bearer <token>``."""
    if isinstance(supplied, str):
        supplied = supplied.encode()
    return hmac.compare_digest(supplied, f"Bearer {token}".encode())
