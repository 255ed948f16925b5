"""The worker's HTTP server: the OpenAI API over one engine, plus health, readiness and metrics.

Requests are parsed and validated here (strict types, OpenAI-style 4xx bodies) so the engine only
ever sees well-formed work; a bad request is answered without touching anything in flight.
"""

from __future__ import annotations

import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.config import WorkerConfig
from tandem.errors import CLIENT_CLOSED_REQUEST, APIError, add_openai_error_handlers, error_body
from tandem.metrics import EngineMetrics
from tandem.openai.chat import ChatCompletionRequest
from tandem.openai.choices import combined, held_until, request_choices, staggered
from tandem.openai.model_routes import add_model_routes
from tandem.openai.protocol import CompletionRequest, check_request, check_token_ids
from tandem.openai.tokenize_routes import add_tokenize_routes
from tandem.protocol import LayoutFingerprint, SamplingParams
from tandem.server import request_id
from tandem.server.body_limit import BodySizeLimit
from tandem.server.internal_auth import InternalAuth, internal_headers, internal_token
from tandem.server.json_response import FastJSONResponse
from tandem.server.sse import (
    CancelOnDisconnect,
    ClientDisconnected,
    EventStreamResponse,
    openai_stream,
)
from tandem.tokenizer import Tokenizer
from tandem.workers.async_engine import AsyncEngine, EngineDeadError
from tandem.workers.internal_api import AgentDirectory, add_internal_routes
from tandem.workers.kv_transfer import KVTransfer
from tandem.workers.lora_routes import add_lora_routes, resolve_lora, served_adapters
from tandem.workers.request_checks import parse_body


class ServingContext:
    """What the routes need: the engine, the tokenizer, the served name and the limits."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, served_name: str, max_model_len: int,
                 config: WorkerConfig, metrics: EngineMetrics, layout: LayoutFingerprint,
                 kv_transfer: KVTransfer | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.config = config
        self.metrics = metrics
        self.registry = metrics.registry
        self.draining = False
        self.channel_answering: set = set()  # the router channel's answers not yet sent (add_channel_route)
        self.channel_connections: set = set()  # the routers' open channels
        # P/D
        self.layout = layout
        self.kv_transfer = kv_transfer
        self.advertise_url = config.advertise_url or f"http://{config.host}:{config.port}"
        self.http = httpx.AsyncClient(headers=internal_headers())  # to peer workers' internal endpoints
        self.agents = AgentDirectory(self.http)


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="Tandem worker", version="0.1.0")
    app.add_middleware(BodySizeLimit, max_bytes=ctx.config.max_body_bytes)
    app.add_middleware(InternalAuth, token=internal_token())

    add_openai_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        return JSONResponse(error_body(503, str(exc)), status_code=503)

    def engine_trouble() -> str | None:
        """Why the engine cannot serve, or None."""
        if not ctx.engine.alive:
            return "engine loop is not running"
        busy_s = ctx.engine.busy_for()
        if busy_s > ctx.config.stall_timeout_s:
            return f"engine step has run for {busy_s:.0f} s (stall timeout {ctx.config.stall_timeout_s:g} s)"
        return None

    @app.get("/health")
    @app.head("/health")  # HEAD too (405 otherwise): load balancers and uptime checks send it
    async def health():
        if trouble := engine_trouble():
            return JSONResponse(error_body(503, trouble), status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    @app.head("/ready")
    async def ready():
        if trouble := engine_trouble() or ("draining" if ctx.draining else None):
            return JSONResponse(error_body(503, trouble), status_code=503)
        return {"status": "ready", "role": ctx.config.role}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)

    add_model_routes(app, ctx.served_name, lambda: ctx.max_model_len, lambda: served_adapters(ctx))
    add_lora_routes(app, ctx)

    async def encode(text: str, add_special_tokens: bool) -> list[int]:
        return ctx.tokenizer.encode(text, add_special_tokens)

    add_tokenize_routes(app, ctx.served_name, ctx.tokenizer, lambda: ctx.max_model_len, encode)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        lora = resolve_lora(ctx, body.model)
        prompts = [ctx.tokenizer.encode(p) if isinstance(p, str) else check_token_ids(ctx.tokenizer.vocab_size, p)
                   for p in body.prompts()]
        params = body.sampling_params(16, ctx.tokenizer.vocab_size)
        return await respond(ctx, request, body, prompts, params, lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        body.use_tool_call_parser(ctx.config.engine.tool_call_parser)
        lora = resolve_lora(ctx, body.model)
        prompt_ids = ctx.tokenizer.encode(body.prompt_text(ctx.tokenizer), add_special_tokens=False)
        params = body.sampling_params(max(1, ctx.max_model_len - len(prompt_ids)), ctx.tokenizer.vocab_size)
        return await respond(ctx, request, body, [prompt_ids], params, lora)

    add_internal_routes(app, ctx)
    return app


async def respond(ctx: ServingContext, request: Request, body: CompletionRequest | ChatCompletionRequest,
                  prompts: list[list[int]], params: SamplingParams, lora: str | None = None):
    rid = request_id.from_headers(request.scope["headers"])
    request_id.use(rid)
    await check_request(body, prompts, params, ctx.max_model_len)
    choices = request_choices(body, prompts, params, lora or ctx.served_name, ctx.tokenizer)
    arrival = time.monotonic()
    streams = staggered(choices, body.n, lambda c, after: held_until(
        after, ctx.engine.generate(c.request_id, c.prompt_ids, c.params, arrival, lora=lora)))
    fmt, outputs = combined(choices, body.n, streams)
    if body.stream:
        response = EventStreamResponse(openai_stream(fmt, outputs, body.usage_in_stream, stream_error_body))
        response.headers[request_id.HEADER] = rid
        return response
    try:
        # Watched from the start: a client that leaves during a long prompt's prefill, before any output, stops it
        # at the next step rather than at the prefill's end (closing the iterator aborts the request).
        async with CancelOnDisconnect(request.receive):
            async for out in outputs:
                fmt.add(out)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    finally:
        await outputs.aclose()
    return FastJSONResponse(fmt.final(), headers={request_id.HEADER: rid})  # plain JSON types: no jsonable_encoder


def stream_error_body(exc: Exception) -> dict | None:
    """The error event that ends a stream the engine cannot finish (see tandem.server.sse.openai_stream)."""
    if isinstance(exc, EngineDeadError):
        return error_body(503, str(exc))
    return error_body(400, str(exc)) if isinstance(exc, ValueError) else None


