"""One WebSocket to a worker's /internal/ws carrying every request the router sends it (the message format is
in tandem.workers.channel). A request is a message out and its answers in, under an id: no HTTP request to
build, no response headers to parse, no chunked body, no pooled connection to take and give back.

The connection failing fails every request on it at once, with the transport error an HTTP request to a dead
worker raises, so the orchestrator retries or resumes them as it would have. Heartbeats find a worker that
stopped answering without closing its socket.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import orjson

HEARTBEAT_S = 20.0  # a ping every 20 s; no pong within half of that (aiohttp's rule) closes the connection


class ChannelClosed(aiohttp.ServerDisconnectedError):
    """The worker's connection closed before the request's answer came (a transport error, like HTTP's)."""


class WorkerChannel:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.closed = False
        self._answers: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, worker_url: str) -> WorkerChannel:
        """aiohttp.WSServerHandshakeError when the worker has no channel (an older worker)."""
        return cls(await session.ws_connect(f"{worker_url}/internal/ws", heartbeat=HEARTBEAT_S, max_msg_size=0))

    async def send(self, path: str, body: dict) -> tuple[int, asyncio.Queue]:
        """Sends a request; its answers (dicts, then None if the connection closes) arrive on the queue. The
        caller must call forget(id) when done with them."""
        if self.closed:
            raise ChannelClosed("the worker's channel is closed")
        request_id = next(self._ids)
        answers = self._answers[request_id] = asyncio.Queue()
        try:
            await self.ws.send_bytes(orjson.dumps({"id": request_id, "path": path, "body": body}))
        except (ConnectionError, RuntimeError) as exc:  # closing or closed under us
            self.forget(request_id)
            raise ChannelClosed(str(exc)) from None
        return request_id, answers

    def forget(self, request_id: int) -> None:
        self._answers.pop(request_id, None)

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    answer = orjson.loads(message.data)
                    answers = self._answers.get(answer.get("id"))
                    if answers is not None:  # else a request its caller gave up on
                        answers.put_nowait(answer)
        except (aiohttp.ClientError, ValueError):
            pass
        finally:
            self.closed = True
            for answers in self._answers.values():
                answers.put_nowait(None)

    async def close(self) -> None:
        await self.ws.close()
        await self._reader
