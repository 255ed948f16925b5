"""The internal API multiplexed on one WebSocket per router: GET /internal/ws.

Each prefill, decode or abort call is a message under an id; the bodies, answers and errors are the HTTP
routes'. The message format: docs/architecture.md ("The P/D protocol").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import BaseModel

from tandem.errors import APIError, error_body
from tandem.workers.request_checks import validate_payload

log = logging.getLogger(__name__)

# path -> (body model, handler); a handler answers a dict, or an async iterator of (event, last) for a stream.
ChannelRoutes = dict[str, tuple[type[BaseModel], Callable[[BaseModel], Awaitable]]]

def add_channel_route(app: FastAPI, routes: ChannelRoutes, connections: set[WebSocket]) -> set[asyncio.Task]:
    """Returns the tasks answering a message, over every connection: each leaves the set once its answer is sent
    (a worker's drain waits for them: workers/main.py). `connections`: kept up to date with the open channels (for
    notify_all)."""
    answering: set[asyncio.Task] = set()

    @app.websocket("/internal/ws")
    async def channel(ws: WebSocket):
        await ws.accept()
        connections.add(ws)
        serving: dict[int | str, asyncio.Task] = {}  # message id -> the task answering it
        try:
            while True:
                frame = await ws.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                message = parse_message(frame.get("bytes") or frame.get("text") or b"")
                if message is None:
                    await send(ws, {"id": None, "status": 400, "body": error_body(400, MALFORMED)})
                elif message.get("cancel"):
                    task = serving.get(message["id"])
                    if task is not None:
                        cancel_once_started(task)
                elif message["id"] in serving:  # its cancel would reach only one of the two
                    await send(ws, {"id": message["id"], "status": 400,
                                    "body": error_body(400, "a request with this id is already in flight")})
                else:
                    request_id = message["id"]
                    task = serving[request_id] = asyncio.get_running_loop().create_task(
                        serve_message(ws, routes, message))
                    answering.add(task)
                    task.add_done_callback(lambda t, i=request_id: (serving.pop(i, None), answering.discard(t)))
        except WebSocketDisconnect:
            pass
        finally:
            connections.discard(ws)
            for task in list(serving.values()):  # the router is gone: nobody reads these answers
                cancel_once_started(task)

    return answering


async def notify_all(connections: set[WebSocket], notice: str) -> None:
    """Tells every router on a channel `notice` at once (a message without an id): "draining" takes this worker
    out of their rotation before their next probe would."""
    for ws in list(connections):
        await send(ws, {"id": None, "notice": notice})


def cancel_once_started(task: asyncio.Task) -> None:
    """Cancel a request's task after its first step. A task cancelled before it ran never runs its coroutine at all,
    so nothing of the handler's own cleanup would run: a decode's release of its prefill lease, for one (a call and
    its cancel can arrive in one read, as the router's corked writes send them). Its first step was scheduled when
    the task was made, so this cancel, scheduled now, lands after it."""
    asyncio.get_running_loop().call_soon(task.cancel)


MALFORMED = "a channel message is a JSON object with an id (an int or a string), a path and a body"


def parse_message(raw: bytes | str) -> dict | None:
    """A message with a usable id; None for anything else."""
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("id"), (int, str)):
        return None
    return message


async def serve_message(ws: WebSocket, routes: ChannelRoutes, message: dict) -> None:
    request_id = message["id"]
    try:
        route = routes.get(message.get("path"))
        if route is None:
            raise APIError(404, f"no channel route {message.get('path')!r}; known: {sorted(routes)}")
        model, handler = route
        answer = await handler(validate_payload(message.get("body"), model))
    except APIError as exc:
        await send(ws, {"id": request_id, "status": exc.status, "body": exc.body()})
        return
    except Exception:  # a bug must fail this request only, never the channel and the others on it
        log.exception("channel request %s failed", request_id)
        await send(ws, {"id": request_id, "status": 500, "body": error_body(500, "internal error")})
        return
    if isinstance(answer, dict):
        await send(ws, {"id": request_id, "body": answer})
    else:
        await send_stream(ws, request_id, answer)


async def send_stream(ws: WebSocket, request_id, events: AsyncIterator[tuple[dict, bool]]) -> None:
    """A stream's events, then its end. A failure mid-stream ends it with a 500 error event (the router takes
    the request elsewhere); a router that left ends it here, which stops the request."""
    try:
        async for event, last in events:
            if not await send(ws, {"id": request_id, "event": event, "done": last}):
                return
            if last:
                return
        await send(ws, {"id": request_id, "done": True})
    except Exception:
        log.exception("channel stream %s failed", request_id)
        await send(ws, {"id": request_id, "event": error_body(500, "internal error"), "done": True})
    finally:
        await events.aclose()


async def send(ws: WebSocket, message: dict) -> bool:
    """False when the router's connection is gone."""
    try:
        await ws.send_bytes(orjson.dumps(message))
        return True
    except (WebSocketDisconnect, RuntimeError, OSError):  # RuntimeError: a send after the close
        return False
