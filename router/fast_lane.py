"""The router's two hot endpoints served straight on ASGI, in front of the FastAPI app.

Per request, FastAPI's stack (error middlewares, the body-limit middleware, route matching, dependency
resolution, request/response wrappers) cost the router more CPU than tokenizing, routing and proxying did
in a profile under benchmarks/router.py (which prints the router's CPU per request, the measure).
POST /v1/completions and /v1/chat/completions therefore skip it: read the body under the size cap,
validate it with the same pydantic model, call the same handler, send its response. FastAPI still declares
both routes, so /openapi.json documents them, and serves every other path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from tandem.errors import APIError, api_error_response, validation_error_response
from tandem.server import request_id
from tandem.server.body_limit import declared_length_error, too_large
from tandem.server.graceful import shutting_down_response
from tandem.server.response_head import head_with_body

Handler = Callable[[BaseModel, Request], Awaitable[Response]]


class FastLane:
    """ASGI app: POSTs to `routes` ({path: (request model, handler)}) here, everything else to `app`."""

    def __init__(self, app, routes: dict[str, tuple[type[BaseModel], Handler]], max_body_bytes: int):
        self.app = app
        self.routes = routes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = head_with_body(send)  # every answer's head and first body part in one write
        route = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
        if route is None:
            return await self.app(scope, receive, send)
        model, handler = route
        rid = request_id.from_headers(scope["headers"])
        request_id.use(rid)  # this request's task: its log lines and its calls to workers carry it
        try:
            body = await self._read_body(scope, receive)
            response = await handler(model.model_validate_json(body), Request(scope, receive))
        except ValidationError as exc:
            response = validation_error_response(exc.errors(include_url=False))
        except APIError as exc:
            response = api_error_response(exc)
        except asyncio.CancelledError:
            # Only uvicorn cancels a request's task (a client that leaves is ClientDisconnected): the server stops
            # and its graceful wait is over (tandem.server.graceful). Said so, rather than uvicorn's plain-text 500. Here
            # rather than by wrapping the app in AnswerOnShutdown as the worker does: a wrapped `send` is not
            # uvicorn's own, and head_with_body would fall back to two writes per answer.
            response = shutting_down_response()
        response.headers[request_id.HEADER] = rid
        await response(scope, receive, send)

    async def _read_body(self, scope, receive) -> bytes:
        """The whole body, refused with 413 past the cap: at once when Content-Length says so, else
        (chunked) as soon as the bytes received pass it."""
        refused = declared_length_error(scope, self.max_body_bytes)
        if refused is not None:
            raise refused
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(400, "the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, too_large(self.max_body_bytes))
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if not body:
            raise APIError(400, "request body must be a JSON object")
        return body
