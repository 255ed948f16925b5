"""One WebSocket to a worker's /internal/ws carrying every request the router sends it (the message format is
in tandem.workers.channel). A request is a message out and its answers in, under an id: no HTTP request to
build, no response headers to parse, no chunked body, no pooled connection to take and give back.

The connection failing fails every request on it at once, with the transport error an HTTP request to a dead
worker raises, so the orchestrator retries or resumes them as it would have. Heartbeats find a worker that
stopped answering without closing its socket; a watchdog fails a request that heard nothing for the read
timeout, as an HTTP read times out, when the worker still answers pings but not that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Callable

import aiohttp
import orjson

from tandem.server.background import spawn

HEARTBEAT_S = 20.0  # a ping every 20 s; no pong within half of that (aiohttp's rule) closes the connection
HANDSHAKE_TIMEOUT_S = 10.0


class ChannelClosed(aiohttp.ServerDisconnectedError):
    """The worker's connection closed before the request's answer came (a transport error, like HTTP's)."""


CLOSED = None  # the answer a request gets when the connection closes
TIMED_OUT = "timed out"  # ... and when the watchdog gives up on it


class Inbox:
    """One request's answers as they arrive. take() hands over all that arrived since the last take: one answer
    while the caller keeps up, several when it falls behind."""

    __slots__ = ("answers", "heard", "answered", "_waiter")

    def __init__(self, now: float):
        self.answers: list = []
        self.heard = now  # when the request was sent or last answered: what the watchdog reads
        self.answered = False  # the worker sent the answer's end: it is done with the request
        self._waiter: asyncio.Future | None = None

    def put(self, answer) -> None:
        self.answers.append(answer)
        if answer is not CLOSED and answer is not TIMED_OUT and (answer.get("done") or "event" not in answer):
            self.answered = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list:
        if not self.answers:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        answers, self.answers = self.answers, []
        return answers


class WorkerChannel:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, read_timeout_s: float,
                 on_notice: Callable[[str], None] | None = None):
        self.ws = ws
        self.on_notice = on_notice  # called with a notice the worker sends unasked ("draining")
        self.closed = False
        self._aborted = False
        self.read_timeout_s = read_timeout_s
        self._inboxes: dict[int, Inbox] = {}
        self._ids = itertools.count()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.create_task(self._watch())
        self._reader = loop.create_task(self._read())  # cancels the watchdog when the connection ends

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, worker_url: str, read_timeout_s: float,
                      on_notice: Callable[[str], None] | None = None) -> WorkerChannel:
        """aiohttp.WSServerHandshakeError when the worker has no channel (an older worker)."""
        # Bounded: a hung worker's kernel still accepts the connection, but nothing answers the upgrade, and every
        # request waiting for this connect would wait with it.
        ws = await asyncio.wait_for(session.ws_connect(f"{worker_url}/internal/ws", heartbeat=HEARTBEAT_S,
                                                       max_msg_size=0), HANDSHAKE_TIMEOUT_S)
        channel = cls(ws, read_timeout_s, on_notice)
        cork(ws, busy=lambda: len(channel._inboxes) > 1)
        return channel

    async def send(self, path: str, body: dict) -> tuple[int, Inbox]:
        """Sends a request; its answers (dicts, then CLOSED or TIMED_OUT if it comes to that) arrive in the
        inbox. The caller must call forget(id) when done with them."""
        if self.closed:
            raise ChannelClosed("the worker's channel is closed")
        request_id = next(self._ids)
        inbox = self._inboxes[request_id] = Inbox(asyncio.get_running_loop().time())
        try:
            await self.ws.send_bytes(orjson.dumps({"id": request_id, "path": path, "body": body}))
        except (ConnectionError, RuntimeError) as exc:  # closing or closed under us
            self.forget(request_id)
            raise ChannelClosed(str(exc)) from None
        except BaseException:  # cancelled while the send waited for the socket to drain
            self.forget(request_id)
            raise
        return request_id, inbox

    def forget(self, request_id: int) -> None:
        """Done with a request's answers. One the worker has not finished is cancelled there, as an HTTP request
        stops when its client closes the connection (the caller gave up: its client left, or it timed out)."""
        inbox = self._inboxes.pop(request_id, None)
        if inbox is not None and not inbox.answered and not self.closed:
            spawn(self._cancel(request_id))

    async def _cancel(self, request_id: int) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # closing under us: that stops it too
            await self.ws.send_bytes(orjson.dumps({"id": request_id, "cancel": True}))

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self.ws:
                if message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    answer = orjson.loads(message.data)
                    if not isinstance(answer, dict):
                        break  # not this protocol's: the channel is no use, as for a frame that is not JSON
                    if answer.get("id") is None and isinstance(answer.get("notice"), str):
                        if self.on_notice is not None:
                            self.on_notice(answer["notice"])
                        continue
                    inbox = self._inboxes.get(answer.get("id"))
                    if inbox is not None:  # else a request its caller gave up on
                        inbox.put(answer)
                        inbox.heard = loop.time()
        except (aiohttp.ClientError, ValueError, TypeError):  # an answer that is not JSON, or an unhashable id
            pass
        except asyncio.CancelledError:
            if not self._aborted:
                raise
        finally:
            self._close_out()

    def _close_out(self) -> None:
        """The channel's end, once: every request on it fails, the watchdog stops, the connection is closed."""
        if self.closed:
            return
        self.closed = True
        self._watchdog.cancel()
        for inbox in self._inboxes.values():
            inbox.put(CLOSED)
        if not self.ws.closed:  # nobody reads it any more: end it, and the worker's work for it
            spawn(self.ws.close())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.read_timeout_s / 4)
            silent_since = loop.time() - self.read_timeout_s
            for inbox in self._inboxes.values():
                if inbox.heard < silent_since:
                    inbox.put(TIMED_OUT)
                    inbox.heard = math.inf  # once is enough

    def abort(self) -> None:
        """Fail every request on the channel now and close it, without waiting for the worker (which may not
        answer): what the connection breaking would do. Closed out here, not only by the reader's end: a reader
        cancelled before its first step (the channel made in this same pass of the loop) never runs its cleanup."""
        self._aborted = True
        self._close_out()
        self._reader.cancel()

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.wait([self._reader])  # its end, however it came (an aborted reader ends cancelled)


def cork(ws: aiohttp.ClientWebSocketResponse, busy: Callable[[], bool]) -> None:
    """Have the messages sent on `ws` in one pass of the event loop leave in one write while `busy()`
    (CorkedTransport). Left as it is where aiohttp's writer is not as expected (its transport is not public API)."""
    writer = getattr(ws, "_writer", None)
    if writer is not None and hasattr(writer, "transport") and not isinstance(writer.transport, CorkedTransport):
        writer.transport = CorkedTransport(writer.transport, busy)


class CorkedTransport:
    """A transport whose writes in one pass of the event loop go out as one, at the start of the next pass, while
    `busy()` (other requests in flight on the connection); when not, a write goes out at once.

    Under load many requests reach the router in one pass and each sends a frame to its worker: one system call
    each, which on loopback also runs the receiving side's TCP work. Frames are self-delimiting, so they may share
    a write. Measured by benchmarks/router.py (router CPU per request). The price, one pass of the loop before a
    frame leaves, is not paid by a lone request. Everything but write() is the transport's own."""

    def __init__(self, transport: asyncio.Transport, busy: Callable[[], bool]):
        self._transport = transport
        self._busy = busy
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if not self._pending:
            if not self._busy():
                self._transport.write(data)
                return
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self._transport.is_closing():  # closed meanwhile: its requests fail with the connection
            self._transport.write(b"".join(pending))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
