"""The least a Python router on Tandem's stack can add: reference targets for benchmarks/router.py.

uvicorn (uvloop, httptools) takes the request and passes it to the next backend (round robin), and the answer
goes back as it arrives. No validation, tokenizing, routing, admission or metrics: what remains is the HTTP
server, the call to the backend and the event loop. Two ways to call the backend:
  http (default)  aiohttp forwards the body unchanged to the backend's OpenAI endpoint: the floor of a router
                  with an HTTP request per worker call (ours with --worker-transport http).
  channel         tandem's WorkerClient sends it on the backend's multiplexed WebSocket (/internal/ws) as a
                  decode call, as our router does by default, and the floor formats the events it gets back as
                  the OpenAI answer (the prompt is not tokenized: a mock backend does not read it).
With --work essential (channel only) the floor also does, with tandem's own code, the work issue 5 requires of
the router on every request, and nothing else: validate the body (the router's pydantic model), tokenize the
prompt, build the sampling parameters, hash the prompt's blocks, place its routing key on the sticky key table
over the hash ring, send the token ids, and format the answer with the router's formatter. No admission, token
buckets, dispatch slots, metrics, failure handling, accounting or disconnect handling: the gap between it and our
router is what the rest of our per-request path costs, and the gap between it and sglang-router is what the
required work costs in Python.
The gap between a floor and our router on the same transport is what our own per-request work costs (at high
concurrency mostly as the queueing its CPU adds); the gap between a floor and sglang-router is the stack's. A
floor is not quite the least: it writes an answer's head and body in two writes where our router joins them
(tandem.server.response_head), and collects garbage at CPython's default threshold, so the gap is a lower bound.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/proxy_floor.py --port 9100 [--transport channel \
        [--work essential]] --backend URL [--backend URL ...]
"""

from __future__ import annotations

import argparse
import itertools
import time

import aiohttp
import orjson
import uvicorn

from tandem.config import RouterConfig
from tandem.hashing import block_hashes, model_seed
from tandem.openai.formatting import CompletionFormatter
from tandem.openai.protocol import CompletionRequest, new_id, now
from tandem.router.orchestrator import decode_delta
from tandem.router.policies.key_table import KeyAssignments
from tandem.router.policies.ring import HashRing, routing_key
from tandem.router.worker_client import WorkerClient
from tandem.server.sse import DONE, sse_event
from tandem.tokenizer import load_tokenizer


def floor_app(make_client, forward):
    """ASGI app: the lifespan, a client to the backends made on first use (it belongs to the serving loop) and
    closed at shutdown, and each request handed to `forward(client, scope, receive, send)`."""
    client = None

    async def app(scope, receive, send):
        nonlocal client
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if client is not None:
                await client.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if client is None:
            client = make_client()
        await forward(client, scope, receive, send)

    return app


async def _body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def send_json(send, answer: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


def http_app(backends: list[str]):
    turn = itertools.cycle(backends)

    async def forward(session: aiohttp.ClientSession, scope, receive, send):
        body = await _body(receive)
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

    return floor_app(lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)), forward)


def channel_app(backends: list[str]):
    turn = itertools.cycle(backends)
    ids = itertools.count()

    async def forward(client: WorkerClient, scope, receive, send):
        request = orjson.loads(await _body(receive))
        stream = bool(request.get("stream"))
        call = {"request_id": f"floor-{next(ids)}", "sampling": {"max_tokens": request.get("max_tokens") or 16},
                "prompt_token_ids": [0], "kv_handle": None, "first_token_id": None, "coalesce_after_first": not stream}
        batches = client.event_batches(next(turn), "/internal/decode", call)
        head = {"id": call["request_id"], "object": "text_completion", "created": int(time.time()),
                "model": request.get("model")}
        if not stream:
            text, finish = [], None
            async for batch in batches:
                text += [event.get("text", "") for event in batch]
                finish = batch[-1].get("finish_reason") or finish
            answer = orjson.dumps({**head, "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish}]})
            await send_json(send, answer)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for batch in batches:  # one event per batch that arrived together, as our router relays them
            choice = {"index": 0, "text": "".join(e.get("text", "") for e in batch),
                      "finish_reason": batch[-1].get("finish_reason")}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps({**head, "choices": [choice]})
                        + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return floor_app(WorkerClient, forward)


def essential_app(backends: list[str], model: str):
    config = RouterConfig(model=model)  # the router's defaults: block size, routing blocks, key table
    tokenizer = load_tokenizer(model)
    ring = HashRing(backends)
    table = KeyAssignments(config.key_eps, config.key_ttl_s, config.max_routing_keys)
    seed = model_seed(model)

    async def forward(client: WorkerClient, scope, receive, send):
        request = CompletionRequest.model_validate_json(await _body(receive))
        ids = tokenizer.encode(request.prompt)
        params = request.sampling_params(request.max_tokens or 16, tokenizer.vocab_size)
        hashes = block_hashes(ids, config.block_size, seed)
        key = routing_key(ids, config.block_size, seed, config.routing_blocks, hashes)
        url = table.kept(key, lambda u: True) or table.assign(key, list(ring.walk(key)))
        call = {"request_id": new_id("cmpl"), "sampling": params.model_dump(), "prompt_token_ids": ids,
                "kv_handle": None, "first_token_id": None, "coalesce_after_first": not request.stream}
        fmt = CompletionFormatter(call["request_id"], request.model, now(), tokenizer, len(ids))
        batches = client.event_batches(url, "/internal/decode", call)
        deltas = (decode_delta(batch) async for batch in batches)
        if not request.stream:
            async for delta in deltas:
                fmt.add(delta)
            answer = orjson.dumps(fmt.final())
            await send_json(send, answer)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for delta in deltas:
            events = "".join(sse_event(chunk) for chunk in fmt.chunks(delta))
            await send({"type": "http.response.body", "body": events.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": DONE.encode(), "more_body": False})

    return floor_app(WorkerClient, forward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True, help="backend base URL (repeat)")
    ap.add_argument("--transport", choices=("http", "channel"), default="http")
    ap.add_argument("--work", choices=("none", "essential"), default="none",
                    help="essential: the router's required work per request too (channel only; module docstring)")
    ap.add_argument("--model", default="smollm2", help="the tokenizer's model, for --work essential")
    args = ap.parse_args()
    backends = [b.rstrip("/") for b in args.backend]
    if args.work == "essential":
        if args.transport != "channel":
            ap.error("--work essential runs on --transport channel")
        app = essential_app(backends, args.model)
    else:
        app = (channel_app if args.transport == "channel" else http_app)(backends)
    # Served as our router is (proxy_headers off), so that the gap between the two is the router's own work.
    uvicorn.run(app, host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False, loop="uvloop", http="httptools", proxy_headers=False)


if __name__ == "__main__":
    main()
