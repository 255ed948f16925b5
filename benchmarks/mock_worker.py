"""A zero-think-time backend for router benchmarks: speaks the OpenAI API and Tandem's internal protocol.

One process per backend. Every answer is a fixed completion, cut to the request's max_tokens, whose text names
the backend ("<name>:0 <name>:1 ..."), so a client can tell where its request landed through any router; the
backend also counts what it served (GET /stats, POST /stats/reset).

  OpenAI (what sglang-router proxies):   POST /v1/completions, /v1/chat/completions, GET /v1/models,
                                          /health, /health_generate, /get_server_info, /get_model_info
  Tandem internal (what our router uses): GET /ready, /internal/load, POST /internal/prefill,
                                          /internal/decode (SSE), /internal/abort, /internal/kv/release,
                                          and the first three multiplexed on GET /internal/ws

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/mock_worker.py --port 9001 --name b0 [--tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections import Counter

from aiohttp import WSMsgType, web

MODEL = "smollm2"
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def sse(payload: dict) -> bytes:
    return b"data: " + _dumps(payload).encode() + b"\n\n"


class MockBackend:
    def __init__(self, name: str, tokens: int, block_size: int = 16):
        self.name = name
        self.block_size = block_size
        self.pieces = [f"{name}:{i} " for i in range(tokens)]
        self.token_ids = list(range(1000, 1000 + tokens))
        self.served: Counter[str] = Counter()
        self.leases = 0
        self.layout = {"model": MODEL, "dtype": "float32", "block_size": block_size, "num_layers": 30,
                       "num_kv_heads": 3, "head_dim": 64, "tp_rank": 0}

    # -- OpenAI ------------------------------------------------------------------------------
    def _openai_body(self, chat: bool, n_prompt: int, pieces: list[str]) -> dict:
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
        return {"id": "cmpl-mock", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": MODEL, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(pieces),
                          "total_tokens": n_prompt + len(pieces)}}

    async def openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.served["openai"] += 1
        prompt = body.get("prompt") if not chat else body.get("messages")
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        pieces = self.pieces[:max(1, body.get("max_tokens") or len(self.pieces))]
        if not body.get("stream"):
            return web.Response(body=_dumps(self._openai_body(chat, n_prompt, pieces)).encode(),
                                content_type="application/json")
        resp = await self._sse_response(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": "length" if last else None}
                      if chat else {"index": 0, "text": piece, "logprobs": None,
                                    "finish_reason": "length" if last else None})
            await resp.write(sse({"id": "cmpl-mock", "object": obj, "created": 0, "model": MODEL,
                                  "choices": [choice]}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _sse_response(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    # -- Tandem internal protocol --------------------------------------------------------------
    def prefill_answer(self, body: dict, host: str) -> dict:
        self.served["prefill"] += 1
        n = len(body["prompt_token_ids"])
        self.leases += 1
        handle = {"source_url": f"http://{host}", "agent_name": f"mock-{self.name}",
                  "lease_id": f"{self.name}-{self.leases}", "block_ids": list(range(-(-n // self.block_size))),
                  "num_tokens": n, "layout": self.layout, "expires_at": time.time() + 30}
        return {"request_id": body["request_id"], "first_token_id": self.token_ids[0],
                "first_token_text": self.pieces[0], "first_token_logprob": None, "finish_reason": None,
                "kv_handle": handle, "num_cached_tokens": 0}

    def decode_events(self, body: dict) -> list[dict]:
        """The stream's events; the last one carries the finish."""
        self.served["decode"] += 1
        # With a first token (disaggregated, or resumed) that token is already out: continue after it.
        start = 1 if body.get("first_token_id") is not None else 0
        # max_tokens counts the first token too, as a real decode worker counts it.
        end = max(min(len(self.pieces), body["sampling"].get("max_tokens", len(self.pieces))), start + 1)
        # One event per token, or (coalesce_after_first) the first at once and the rest in one event.
        steps = [[i] for i in range(start, end)]
        if body.get("coalesce_after_first") and len(steps) > 2:
            steps = [steps[0], list(range(start + 1, end))]
        events = []
        for step in steps:
            chunk = {"token_ids": [self.token_ids[i % len(self.token_ids)] for i in step],
                     "text": "".join(self.pieces[i % len(self.pieces)] for i in step)}
            if step[-1] == end - 1:
                chunk["finish_reason"] = "length"
            if step[0] == start:
                chunk["kv_source"] = "pulled" if body.get("kv_handle") else "local"
            events.append(chunk)
        return events

    async def prefill(self, request: web.Request) -> web.Response:
        return web.Response(body=_dumps(self.prefill_answer(await request.json(), request.host)).encode(),
                            content_type="application/json")

    async def decode(self, request: web.Request) -> web.StreamResponse:
        events = self.decode_events(await request.json())
        resp = await self._sse_response(request)
        for i, event in enumerate(events):
            # The last event and [DONE] in one write, as a real worker sends them.
            await resp.write(sse(event) + (b"data: [DONE]\n\n" if i == len(events) - 1 else b""))
        await resp.write_eof()
        return resp

    async def channel(self, request: web.Request) -> web.WebSocketResponse:
        """/internal/ws: the same calls multiplexed on one WebSocket (tandem.workers.channel's format)."""
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for message in ws:
            if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                continue
            call = json.loads(message.data)
            answer_id, path, body = call["id"], call["path"], call["body"]
            if path == "/internal/decode":
                events = self.decode_events(body)
                for i, event in enumerate(events):
                    await ws.send_bytes(_dumps({"id": answer_id, "event": event,
                                                "done": i == len(events) - 1}).encode())
            elif path == "/internal/prefill":
                answer = self.prefill_answer(body, request.host)
                await ws.send_bytes(_dumps({"id": answer_id, "body": answer}).encode())
            else:  # /internal/abort
                await ws.send_bytes(_dumps({"id": answer_id, "body": {"ok": True}}).encode())
        return ws

    async def load(self, _: web.Request) -> web.Response:
        return web.json_response({"role": "both", "free_blocks": 10000, "total_blocks": 10000, "running": 0,
                                  "waiting": 0, "in_flight": 0, "max_model_len": 8192})

    # -- bookkeeping -------------------------------------------------------------------------
    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "served": dict(self.served)})

    async def reset(self, _: web.Request) -> web.Response:
        self.served.clear()
        return web.json_response({"reset": True})

    def app(self) -> web.Application:
        ok = {"status": "ok"}

        async def fixed(_: web.Request, payload=ok) -> web.Response:
            return web.json_response(payload)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                                  "owned_by": "mock"}]})

        async def server_info(_: web.Request) -> web.Response:
            return web.json_response({"model_path": MODEL, "tokenizer_path": MODEL, "dp_size": 1,
                                      "is_generation": True, "version": "mock"})

        async def empty_ok(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"ok": True})

        app = web.Application(client_max_size=16 << 20)
        app.add_routes([
            web.get("/health", fixed), web.get("/health_generate", fixed), web.get("/ready", fixed),
            web.get("/v1/models", models), web.get("/get_server_info", server_info),
            web.get("/get_model_info", server_info), web.get("/internal/load", self.load),
            web.post("/v1/completions", lambda r: self.openai(r, chat=False)),
            web.post("/v1/chat/completions", lambda r: self.openai(r, chat=True)),
            web.post("/internal/prefill", self.prefill), web.post("/internal/decode", self.decode),
            web.get("/internal/ws", self.channel),
            web.post("/internal/abort", empty_ok), web.post("/internal/kv/release", empty_ok),
            web.get("/stats", self.stats), web.post("/stats/reset", self.reset),
        ])
        return app


async def serve(name: str, port: int, tokens: int) -> None:
    runner = web.AppRunner(MockBackend(name, tokens).app(), access_log=None, handle_signals=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    print(f"mock backend {name} on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="b0")
    ap.add_argument("--tokens", type=int, default=4,
                    help="longest completion in tokens (one SSE event each); a request's max_tokens asks for fewer")
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.name, args.port, args.tokens))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
