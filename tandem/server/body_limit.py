"""ASGI middleware that refuses request bodies over a size cap with 413, before they are buffered."""

from __future__ import annotations

from tandem.errors import APIError, send_error


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = declared_length_error(scope, self.max_bytes)
        if refused is not None:
            return await send_error(send, refused.status, refused.message)
        received = 0

        async def counted_receive():
            # Chunked bodies declare no length: count as they arrive. The APIError surfaces where
            # the route reads the body and is answered by the app's APIError handler.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise APIError(413, too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)


def declared_length_error(scope, max_bytes: int) -> APIError | None:
    """The error for a Content-Length header that is malformed (400) or over the cap (413), else None."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is None:
        return None
    if not declared.isdigit():
        return APIError(400, "invalid Content-Length header")
    if int(declared) > max_bytes:
        return APIError(413, too_large(max_bytes))
    return None


def too_large(max_bytes: int) -> str:
    """The 413 message for a body over the cap."""
    return f"request body exceeds the {max_bytes}-byte limit"

