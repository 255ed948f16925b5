"""A shared secret on the workers' internal endpoints (/internal/*, the router's /internal/ws channel).

Those endpoints take what a router or a peer worker sends on trust: a decode request's KV handle names the
worker to pull the prompt's KV from, and what it pulls lands in the decode worker's prefix cache, where other
users' requests find it. Anyone else who can reach a worker's port could therefore plant KV there. With
TANDEM_INTERNAL_TOKEN set (the same value for a deployment's router and workers), workers refuse internal calls
that do not present it, and routers and workers present it on theirs. Unset, the endpoints are open, as on a
laptop where nothing else reaches 127.0.0.1 (`tandem serve` sets one for its processes all the same).
"""

from __future__ import annotations

import hmac
import os

from tandem.errors import send_error

INTERNAL_TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
INTERNAL_TOKEN_HEADER = "x-tandem-internal-token"
_INTERNAL_PREFIX = "/internal/"


def internal_token() -> str | None:
    return os.environ.get(INTERNAL_TOKEN_ENV) or None


def internal_headers() -> dict[str, str]:
    """The header a router or worker sends on every internal call (none when no token is set)."""
    token = internal_token()
    return {INTERNAL_TOKEN_HEADER: token} if token else {}


class InternalAuth:
    """ASGI middleware: an /internal/ request (HTTP or WebSocket) without the token gets 401 (a refused handshake
    for a WebSocket). Everything else passes untouched; with no token set, everything does."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] not in ("http", "websocket") \
                or not scope["path"].startswith(_INTERNAL_PREFIX):
            return await self.app(scope, receive, send)
        presented = dict(scope["headers"]).get(INTERNAL_TOKEN_HEADER.encode(), b"")
        if hmac.compare_digest(presented, self.token):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send_error(send, 401, f"internal endpoint: missing or wrong {INTERNAL_TOKEN_HEADER} header "
                                    f"({INTERNAL_TOKEN_ENV} must match the worker's)")
