"""API keys at the front door: with keys configured, a /v1/* request (and the API's pages, /docs and /redoc)
must present one or gets 401.

Without this, a per-tenant token bucket binds only callers honest enough to send their key: anyone
else is the default tenant. `vllm serve --api-key` has the same gate. /health, /ready, /metrics and
/openapi.json stay open for probes and scrapers. Keys are compared by their SHA-256 digests, so a set
lookup answers and the time it takes says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from starlette.responses import JSONResponse

from tandem.errors import error_body
from tandem.server.headers import header_value

PROTECTED_PREFIX = "/v1/"
PROTECTED_PAGES = ("/docs", "/redoc")  # with their assets (/docs/oauth2-redirect)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header among raw ASGI headers."""
    value = header_value(headers, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class ApiKeyGate:
    """ASGI middleware: lets a /v1/* request (or one for the API's pages) through only with one of `keys` as its
    bearer token."""

    def __init__(self, app, keys: Iterable[str]):
        self.app = app
        self._digests = {_digest(k) for k in keys}
        if not self._digests:
            raise ValueError("ApiKeyGate needs at least one key")

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith(PROTECTED_PREFIX) or path.startswith(PROTECTED_PAGES):
            token = bearer_token(scope["headers"])
            if token is None or _digest(token) not in self._digests:
                message = ("Incorrect API key provided." if token is not None else
                           "No API key provided: send it as the header `Authorization: Bearer <key>`.")
                response = JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
