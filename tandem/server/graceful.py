"""Stopping a server without cutting answers off: what uvicorn leaves out.

On SIGTERM uvicorn stops accepting, waits up to timeout_graceful_shutdown for the requests in flight, then
cancels those still running, and returns at once. asyncio.run then cancels them a second time, before they could
write an ending: a non-streamed request got uvicorn's plain-text 500, a stream a connection cut mid-body.
`GracefulServer` waits a moment for the cancelled requests after its shutdown, and `AnswerOnShutdown` turns a
request cancelled before its answer began into 503 shutting_down (a stream's ending is EventStreamResponse's).
"""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.responses import JSONResponse

from tandem.errors import retry_after
from tandem.server.sse import SHUTTING_DOWN

CANCELLED_REQUESTS_GRACE_S = 2.0  # for the cancelled requests to write their ending


def shutting_down_response() -> JSONResponse:
    return JSONResponse(SHUTTING_DOWN, status_code=503, headers=retry_after(1))


class GracefulServer(uvicorn.Server):
    async def shutdown(self, sockets=None):
        await super().shutdown(sockets)
        pending = [task for task in self.server_state.tasks if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=CANCELLED_REQUESTS_GRACE_S)


class AnswerOnShutdown:
    """ASGI wrapper: a request whose task is cancelled before its answer began gets 503 shutting_down. Only uvicorn
    cancels a request's task, at the end of its graceful shutdown (a client that leaves is told by `receive`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if started:
                raise
            await shutting_down_response()(scope, receive, send)
