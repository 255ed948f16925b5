"""The router's data path to its workers' internal API: JSON posts and SSE streams over kept-alive connections.

aiohttp rather than httpx here because this runs once or twice per request: profiled with py-spy under
benchmarks/router.py (zero-think-time mocks), httpx's streaming POST took about half of the router's CPU per
request (anyio stream layers, a connection-pool expiry scan that probes every pooled socket on each request,
headers and body sent as separate writes). The health probes stay on httpx: once a second, cost is moot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson

from tandem.sse import parse_sse_line

# What a worker that is down, unreachable or too slow raises; the orchestrator moves the request elsewhere.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)

_JSON = {"Content-Type": "application/json"}


class WorkerStatusError(Exception):
    """The worker answered, but not 200: `status` and the message of its OpenAI-style error body."""

    def __init__(self, status: int, message: str):
        super().__init__(f"worker answered {status}: {message}")
        self.status = status
        self.message = message


def _error_message(raw: bytes) -> str:
    try:
        return orjson.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:500].decode(errors="replace")


class WorkerClient:
    def __init__(self, connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0):
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use: an aiohttp session belongs to the event loop it was made in.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout)
        return self._session

    async def post_json(self, url: str, payload: dict, timeout_s: float | None = None) -> dict:
        """The JSON answer of a 200; WorkerStatusError otherwise."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        async with self.session.post(url, data=orjson.dumps(payload), headers=_JSON, timeout=timeout) as r:
            raw = await r.read()
            if r.status != 200:
                raise WorkerStatusError(r.status, _error_message(raw))
            return orjson.loads(raw)

    async def events(self, url: str, payload: dict) -> AsyncIterator[dict]:
        """Each `data:` event of an SSE answer as JSON, read to the end of the stream; WorkerStatusError before
        the first event when the answer is not 200."""
        async with self.session.post(url, data=orjson.dumps(payload), headers=_JSON) as r:
            if r.status != 200:
                raise WorkerStatusError(r.status, _error_message(await r.read()))
            # Read as the bytes arrive and split into lines here: aiohttp's line iterator costs a readline per
            # line, and an event usually comes in one read with its blank line.
            partial = b""
            async for data in r.content.iter_any():
                lines = (partial + data).split(b"\n")
                partial = lines.pop()
                for line in lines:
                    event = parse_sse_line(line)
                    if event is not None:
                        yield event
            event = parse_sse_line(partial)
            if event is not None:
                yield event

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
