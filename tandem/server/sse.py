"""Server-sent events as the OpenAI API and the P/D protocol use them: `data: <json>` lines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import orjson
from starlette.responses import StreamingResponse

from tandem.errors import error_body

if TYPE_CHECKING:
    from tandem.openai.formatting import Formatter

DONE = "data: [DONE]\n\n"
# What a request still running when its server stops (past the graceful shutdown's wait) is told, instead of a
# connection cut mid-answer: the router resumes a worker's stream elsewhere, a client knows to retry.
SHUTTING_DOWN = error_body(503, "the server is shutting down; retry the request", code="shutting_down")


def sse_event(payload: dict) -> str:
    return f"data: {orjson.dumps(payload).decode()}\n\n"


def parse_sse_line(line: str | bytes) -> dict | None:
    """One `data:` line (text, or bytes as read off the socket) as JSON; None for [DONE], blank and non-data
    lines."""
    if isinstance(line, str):
        line = line.encode()
    if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
        return None
    return orjson.loads(line[6:])


async def openai_stream(
    fmt: Formatter, items: AsyncIterator, usage: bool, error_body_of: Callable[[Exception], dict | None]
) -> AsyncIterator[str]:
    """A request's OpenAI streaming body, flushed item by item as they come: the formatter's first chunk, its
    chunks for each item (engine outputs on a worker, deltas on the router), the usage chunk when asked, then
    [DONE]. The finishing item's chunks, the usage chunk and [DONE] leave in one write: they are ready at the
    same moment, and one write is one send and one wake-up of the client. An exception that `error_body_of`
    maps to a body ends the stream with that error event and [DONE] (the status line is long gone); any other
    propagates. Closing `items` at the end is what aborts the request upstream when the client goes away
    (this generator is cancelled then)."""
    tail = ""  # the finishing item's events, sent with [DONE]
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield sse_event(first)
        async for item in items:
            events = "".join(sse_event(chunk) for chunk in fmt.chunks(item))
            if item.finished:
                tail += events
            elif events:
                yield events
        if usage:
            tail += sse_event(fmt.usage_chunk())
        yield tail + DONE
    except Exception as exc:
        body = error_body_of(exc)
        if body is None:
            raise
        yield tail + sse_event(body) + DONE
    finally:
        await items.aclose()


class EventStreamResponse(StreamingResponse):
    """A text/event-stream answer that stops when the client goes away (closing the body iterator is what
    aborts the request upstream). Starlette's StreamingResponse does this with an anyio task group and cancel
    scope around a disconnect listener (uvicorn speaks ASGI 2.3, so starlette cannot rely on send failing);
    two plain tasks do it here for less CPU per stream (benchmarks/router.py prints the router's CPU per
    streamed request; docs/benchmarks.md has the runs before and after). When the answer completes, uvicorn
    tells `receive` the request is over, so the listener ends by itself. `on_close` runs once the answer is
    over, however it ended: for what a body that never started would have cleaned up (a client can leave while
    the headers are still being sent)."""

    media_type = "text/event-stream"
    # No caching, and no buffering by a proxy in front (nginx's header): each event is to reach the client now.
    HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    def __init__(self, content, *, on_close: Callable[[], None] | None = None, **kwargs):
        super().__init__(content, headers=self.HEADERS, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._stream_until_disconnect(send, receive)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _stream_until_disconnect(self, send, receive) -> None:
        loop = asyncio.get_running_loop()
        streamer = loop.create_task(self.stream_response(send))
        listener = loop.create_task(_until_disconnect(receive))
        try:
            await asyncio.wait((streamer, listener), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # This request itself was cancelled (a client that leaves ends the listener instead): its server
            # stops, and the graceful wait is over. The stream ends with a reason rather than a cut connection,
            # and the task ends there; a second cancellation meanwhile is not swallowed.
            listener.cancel()
            streamer.cancel()
            try:
                await streamer  # it stops writing before the last event goes
            except asyncio.CancelledError:
                if _cancellations(asyncio.current_task()) > 1:
                    raise
            except Exception:  # noqa: BLE001 - whatever it failed with, the stream still gets its end
                pass
            with contextlib.suppress(Exception):  # the connection may be gone already
                await asyncio.wait_for(send({"type": "http.response.body", "more_body": False,
                                             "body": (sse_event(SHUTTING_DOWN) + DONE).encode()}), 1.0)
            return
        if not streamer.done():  # the client left mid-stream
            streamer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await streamer
            return
        if not listener.done():
            listener.cancel()
        streamer.result()  # its exception, if it failed


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client closed its connection before its answer was ready."""


class CancelOnDisconnect:
    """Runs the block in this task, cancelled if the client disconnects meanwhile (ClientDisconnected is raised
    instead of the CancelledError). For an answer built whole before it is sent, a non-streamed completion:
    nothing else reads `receive` until then, so nothing else would notice the client leave, and the work
    would go on to the end for nobody. A streamed answer has EventStreamResponse's listener.

    The listener starts only once the block has run `listen_after_s`: an answer done by then (a short one)
    skips the task it costs (benchmarks/router.py prints the router's CPU per request). A client that leaves
    sooner has its work stopped when the listener starts, at once, since the disconnect is known."""

    def __init__(self, receive, listen_after_s: float = 0.2):
        self.receive = receive
        self.listen_after_s = listen_after_s
        self.gone = False

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.listener: asyncio.Task | None = None
        self.timer = loop.call_later(self.listen_after_s, self._start_listening, loop)

    def _start_listening(self, loop: asyncio.AbstractEventLoop) -> None:
        self.listener = loop.create_task(self._listen())

    async def _listen(self) -> None:
        await _until_disconnect(self.receive)
        self.gone = True
        self.task.cancel()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self.timer.cancel()
        if self.listener is not None:
            self.listener.cancel()
        if exc_type is asyncio.CancelledError and self.gone:
            _uncancel(self.task)
            raise ClientDisconnected from None
        return False  # anything else (a cancellation from elsewhere: server shutdown) goes on


def _cancellations(task: asyncio.Task) -> int:
    """Cancellations asked of this task and not handled (Python 3.10 counts none: taken as one)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 1


def _uncancel(task: asyncio.Task) -> None:
    """The cancellation this task asked for itself is handled (Python 3.10 counts none, and has no uncancel)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()
