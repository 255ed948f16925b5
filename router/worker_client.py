"""The router's data path to its workers' internal API: one multiplexed WebSocket per worker
(router/worker_channel.py) where the worker offers it, else JSON posts and SSE streams over kept-alive HTTP.
Either way a call answers the same dicts and raises the same errors. Why aiohttp: docs/design/routing.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

import aiohttp
import orjson

from tandem.router.worker_channel import CLOSED, TIMED_OUT, ChannelClosed, WorkerChannel
from tandem.server.internal_auth import internal_headers
from tandem.server.sse import parse_sse_line

log = logging.getLogger(__name__)

# What a worker that is down, unreachable or too slow raises; the orchestrator moves the request elsewhere.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)

_JSON = {"Content-Type": "application/json"}
# How a worker without /internal/ws refuses the upgrade: starlette closes an unknown WebSocket route (403),
# aiohttp and others answer 404, or 405 for a path served for other methods.
NO_CHANNEL_STATUSES = (403, 404, 405)
# A worker that refused the upgrade is asked again after this long: the refusal may have come from something in
# front of it (an ingress mid-rollout), or the worker may have been upgraded since.
NO_CHANNEL_RETRY_S = 60.0


# The message a request's task is cancelled with when its worker is dropped (WorkerClient.drop): the cancellation
# becomes a transport error for that request alone.
_DROPPED = "tandem: the worker was dropped"


class WorkerStatusError(Exception):
    """The worker answered, but not 200: `status`, and the message and code of its OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"worker answered {status}: {message}")
        self.status = status
        self.message = message
        self.code = code


class UnreadableAnswer(aiohttp.ClientPayloadError):
    """The worker answered what its protocol never says (not JSON, or an event without its fields): its failure,
    as a cut connection is, so the request moves to another worker and this one is counted as failing."""


def _status_error(status: int, body) -> WorkerStatusError:
    """The error of a non-200 answer from its body: OpenAI-style JSON (already parsed, or the raw bytes), or any."""
    if isinstance(body, bytes):
        try:
            body = orjson.loads(body)
        except ValueError:
            return WorkerStatusError(status, body[:500].decode(errors="replace"))
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return WorkerStatusError(status, str(body)[:500])
    return WorkerStatusError(status, str(error.get("message")), error.get("code"))


def _object(answer, worker: str) -> dict:
    if not isinstance(answer, dict):
        raise UnreadableAnswer(f"{worker} answered {type(answer).__name__}, not a JSON object")
    return answer


def _json(raw: bytes | str, worker: str):
    try:
        return orjson.loads(raw)
    except ValueError as exc:
        raise UnreadableAnswer(f"{worker} answered something that is not JSON: {exc}") from None


class WorkerClient:
    """`transport` "websocket" uses a worker's channel when it has one (HTTP for a worker that has none);
    "http" never does. The read timeout bounds the silence on one request either way."""

    def __init__(self, connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0,
                 transport: Literal["websocket", "http"] = "websocket"):
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self.transport = transport
        self._session: aiohttp.ClientSession | None = None
        self._channels: dict[str, WorkerChannel] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._http_only: dict[str, float] = {}  # worker -> when it answered the upgrade with an HTTP error
        self._http_waits: dict[str, set[asyncio.Task]] = {}  # worker -> tasks waiting on it over HTTP now
        self.on_notice: Callable[[str, str], None] | None = None  # (worker, notice) a worker sends on its channel

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use: an aiohttp session belongs to the event loop it was made in.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout,
                                                  headers=internal_headers())
        return self._session

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s: float | None = None) -> dict:
        """The JSON answer of a 200; WorkerStatusError otherwise."""
        channel = await self._channel(worker)
        if channel is None:
            with self._waiting_on(worker):
                return await self._post_http(f"{worker}{path}", payload, timeout_s)
        request_id, inbox = await channel.send(path, payload)
        try:
            answers = await (asyncio.wait_for(inbox.take(), timeout_s) if timeout_s is not None else inbox.take())
        finally:
            channel.forget(request_id)
        return _object(_checked(answers[0]).get("body"), worker)

    async def event_batches(self, worker: str, path: str, payload: dict) -> AsyncIterator[list[dict]]:
        """The events of a streamed answer, to the end of the stream, in lists: each list holds the events that
        had arrived by the time it was taken, so one event while the router keeps up and several when it falls
        behind (the caller can then relay them as one). WorkerStatusError before the first event when the
        worker refuses the request; a transport error after the events that arrived before it."""
        channel = await self._channel(worker)
        if channel is None:
            async for batch in self._event_batches_http(worker, f"{worker}{path}", payload):
                yield batch
            return
        request_id, inbox = await channel.send(path, payload)
        try:
            while True:
                batch, done = [], False
                try:
                    for answer in await inbox.take():
                        answer = _checked(answer)
                        if "event" in answer:
                            batch.append(answer["event"])
                        if answer.get("done"):
                            done = True
                            break
                except (WorkerStatusError, *TRANSPORT_ERRORS):
                    if batch:  # the events before the failure are the caller's: a resume continues after them
                        yield batch
                    raise
                if batch:
                    yield batch
                if done:
                    return
        finally:
            channel.forget(request_id)

    def drop(self, worker: str) -> None:
        """Fail every request in flight on `worker` now with a transport error, as its connections breaking
        would (the orchestrator retries or resumes them elsewhere): for a worker that stopped answering without
        closing them (hung, or its host cut off), which a heartbeat or the read timeout notices much later."""
        channel = self._channels.get(worker)
        if channel is not None and not channel.closed:
            channel.abort()
        for task in self._http_waits.get(worker, ()):
            task.cancel(_DROPPED)

    @contextlib.contextmanager
    def _waiting_on(self, worker: str):
        """Around each wait for a worker's HTTP answer (and only there): drop() cancels the waiting task, and the
        cancellation becomes the transport error. Outside these waits the task is the caller's, and not cancelled."""
        task = asyncio.current_task()
        waits = self._http_waits.setdefault(worker, set())
        waits.add(task)
        try:
            yield
        except asyncio.CancelledError as exc:
            # Only a cancel of drop()'s alone becomes the transport error; one from the caller (its client left)
            # landing in the same pass of the loop stays a cancel.
            if exc.args != (_DROPPED,) or task.cancelling() > 1:
                raise
            task.uncancel()
            raise aiohttp.ServerDisconnectedError("the worker stopped answering") from None
        finally:
            waits.discard(task)

    async def _channel(self, worker: str) -> WorkerChannel | None:
        """The worker's open channel, connecting it on first use (one connect however many requests wait for
        it); None to use HTTP. A connect failure raises the transport error an HTTP request would have."""
        if self.transport == "http":
            return None
        refused_at = self._http_only.get(worker)
        if refused_at is not None and time.monotonic() - refused_at < NO_CHANNEL_RETRY_S:
            return None
        channel = self._channels.get(worker)
        if channel is not None and not channel.closed:
            return channel
        connecting = self._connecting.get(worker)
        if connecting is None:
            connecting = self._connecting[worker] = asyncio.get_running_loop().create_task(self._connect(worker))
        # Shielded: a request cancelled while it waits must not cancel the connect the others wait for.
        return await asyncio.shield(connecting)

    async def _connect(self, worker: str) -> WorkerChannel | None:
        try:
            self._channels[worker] = channel = await WorkerChannel.connect(
                self.session, worker, self.timeout.sock_read, on_notice=lambda notice: self._notice(worker, notice))
            return channel
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status not in NO_CHANNEL_STATUSES:
                raise  # e.g. a proxy's 502: a transport failure, not an answer about the worker
            log.info("%s has no internal channel (%s); using HTTP", worker, exc.status)
            self._http_only[worker] = time.monotonic()
            return None
        finally:
            del self._connecting[worker]

    def _notice(self, worker: str, notice: str) -> None:
        if self.on_notice is not None:
            self.on_notice(worker, notice)

    async def _post_http(self, url: str, payload: dict, timeout_s: float | None) -> dict:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        async with self.session.post(url, data=orjson.dumps(payload), headers=_JSON, timeout=timeout) as r:
            raw = await r.read()
            if r.status != 200:
                raise _status_error(r.status, raw)
            return _object(_json(raw, url), url)

    async def _event_batches_http(self, worker: str, url: str, payload: dict) -> AsyncIterator[list[dict]]:
        async with contextlib.AsyncExitStack() as stack:
            with self._waiting_on(worker):
                r = await stack.enter_async_context(self.session.post(url, data=orjson.dumps(payload), headers=_JSON))
                if r.status != 200:
                    raise _status_error(r.status, await r.read())
            # Read as the bytes arrive and split into lines here: aiohttp's line iterator costs a readline per
            # line, and the events of one read make one batch.
            partial = b""
            reads = r.content.iter_any()
            while True:
                with self._waiting_on(worker):
                    data = await anext(reads, None)
                if data is None:
                    break
                lines = (partial + data).split(b"\n")
                partial = lines.pop()
                batch = []
                try:
                    for line in lines:
                        if (event := _event(line, worker)) is not None:
                            batch.append(event)
                except UnreadableAnswer:
                    if batch:  # the events before it are the caller's, as before any failure
                        yield batch
                    raise
                if batch:
                    yield batch
            event = _event(partial, worker)
            if event is not None:
                yield [event]

    async def close(self) -> None:
        for channel in list(self._channels.values()):
            await channel.close()
        if self._session is not None:
            await self._session.close()


def _checked(answer: dict | str | None) -> dict:
    """A channel answer; the transport errors for the connection's end and for silence past the read timeout,
    WorkerStatusError for a refusal."""
    if answer is CLOSED:
        raise ChannelClosed("the worker's channel closed")
    if answer is TIMED_OUT:
        raise asyncio.TimeoutError("the worker sent nothing for this request within the read timeout")
    status = answer.get("status", 200)
    if type(status) is not int:
        raise UnreadableAnswer(f"a channel answer's status is {status!r}")
    if status != 200:
        raise _status_error(status, answer.get("body"))
    return answer


def _event(line: bytes, worker: str) -> dict | None:
    try:
        return parse_sse_line(line)
    except ValueError as exc:
        raise UnreadableAnswer(f"{worker} sent an event that is not JSON: {exc}") from None
