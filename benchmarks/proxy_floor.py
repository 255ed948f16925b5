"""The least a Python router on Tandem's stack can add: a reference target for benchmarks/router.py.

uvicorn (uvloop, httptools) takes the request, aiohttp forwards its body unchanged to the next backend's OpenAI
endpoint (round robin) and the answer goes back as it arrives. No validation, tokenizing, routing, admission
or metrics: what remains is the HTTP server, the HTTP client and the event loop, so the gap between this and
our router with an HTTP request per worker call (--worker-transport http) is our own per-request work, and the
gap between this and sglang-router is the stack's.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/proxy_floor.py --port 9100 --backend URL [--backend URL ...]
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
import uvicorn


def make_app(backends: list[str]):
    turn = itertools.cycle(backends)
    session: aiohttp.ClientSession | None = None

    async def app(scope, receive, send):
        nonlocal session
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if session is not None:
                await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if session is None:  # made on first use: it belongs to the serving loop
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with session.post(next(turn) + scope["path"], data=body,
                                headers={"Content-Type": "application/json"}) as r:
            content_type = r.headers.get("Content-Type", "application/json")
            headers = [(b"content-type", content_type.encode())]
            if not content_type.startswith("text/event-stream"):  # one JSON body: read whole, sent with its length
                answer = await r.read()
                headers.append((b"content-length", str(len(answer)).encode()))
                await send({"type": "http.response.start", "status": r.status, "headers": headers})
                await send({"type": "http.response.body", "body": answer})
                return
            await send({"type": "http.response.start", "status": r.status, "headers": headers})
            async for chunk in r.content.iter_any():  # events passed on as they come
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True, help="backend base URL (repeat)")
    args = ap.parse_args()
    uvicorn.run(make_app([b.rstrip("/") for b in args.backend]), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False, loop="uvloop", http="httptools")


if __name__ == "__main__":
    main()
