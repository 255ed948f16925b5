"""The router's OpenAI front door: validate, tokenize once, admit by SLO, dispatch, stream back.

Request bodies are declared as pydantic models so /openapi.json documents them; validation
failures become OpenAI-style 400s. Admission refuses early (429 + Retry-After) rather than let a
request miss its TTFT target in a queue. The two generation endpoints are served by
tandem.router.fast_lane in front of FastAPI (same models, same handlers, less CPU per request).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware.cors import CORSMiddleware

from tandem.errors import CLIENT_CLOSED_REQUEST, APIError, add_openai_error_handlers, error_body, retry_after
from tandem.openai.chat import ChatCompletionRequest, ChatPrompt
from tandem.openai.choices import Choice, combined, request_choices, staggered
from tandem.openai.model_routes import add_model_routes
from tandem.openai.protocol import CompletionRequest, check_request, check_token_ids
from tandem.openai.tokenize_routes import add_tokenize_routes
from tandem.protocol import SamplingParams
from tandem.router.admission import AdmissionRequest, Reject, RejectReason
from tandem.router.admission.prediction import colocated_stall_s, prefill_s
from tandem.router.api_keys import ApiKeyGate, bearer_token
from tandem.router.fast_lane import FastLane
from tandem.router.lora_affinity import resolve_lora, served_adapters
from tandem.router.orchestrator import Trace, no_workers
from tandem.server.body_limit import BodySizeLimit
from tandem.server.headers import header_value
from tandem.server.json_response import FastJSONResponse
from tandem.server.request_id import HEADER as REQUEST_ID_HEADER
from tandem.server.sse import (
    CancelOnDisconnect,
    ClientDisconnected,
    EventStreamResponse,
    openai_stream,
)

log = logging.getLogger(__name__)

SLO_HEADER = "x-tandem-slo-class"
SLO_HEADER_RAW = SLO_HEADER.encode()  # as ASGI gives header names: lower-case bytes


def build_app(router) -> FastLane | ApiKeyGate | CORSMiddleware:
    """`router` is a tandem.router.main.Router: config, tokenizer, pools, admission, orchestrator."""
    pages = {"openapi_url": None, "docs_url": None, "redoc_url": None} if router.config.disable_fastapi_docs else {}
    app = FastAPI(title="Tandem router", version="0.1.0",
                  description="OpenAI-compatible front door of a Tandem prefill/decode deployment", **pages)
    app.add_middleware(BodySizeLimit, max_bytes=router.config.max_body_bytes)

    add_openai_error_handlers(app)

    @app.get("/health")
    @app.head("/health")  # HEAD too (405 otherwise): load balancers and uptime checks send it
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    @app.head("/ready")
    async def ready():
        if not router.decode.healthy():
            return JSONResponse(error_body(503, "no decode worker is ready"), status_code=503)
        return {"status": "ready", "prefill": len(router.prefill.healthy()), "decode": len(router.decode.healthy())}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_model_routes(app, router.served_name, lambda: router.max_model_len, lambda: served_adapters(router))
    add_tokenize_routes(app, router.served_name, router.tokenizer, lambda: router.max_model_len,
                        lambda text, add_special_tokens: tokenize(router, text, add_special_tokens),
                        lambda body, add_special_tokens: chat_prompt_ids(router, body, add_special_tokens))

    async def completions_handler(body: CompletionRequest, request: Request) -> Response:
        lora = resolve_lora(router, body.model)
        vocab = router.tokenizer.vocab_size
        prompts = [await tokenize(router, p) if isinstance(p, str) else check_token_ids(vocab, p) for p in body.prompts()]
        if "max_tokens" not in body.model_fields_set:  # the schema's 16 is a default, not the client's request
            body.max_tokens = None
        params = body.sampling_params(default_max_tokens(router, 16), vocab)
        return await serve(router, request, body, prompts, params, lora)

    async def chat_handler(body: ChatCompletionRequest, request: Request) -> Response:
        body.use_tool_call_parser(router.config.tool_call_parser)  # the router forms the answer: it parses the calls
        lora = resolve_lora(router, body.model)
        ids = await chat_prompt_ids(router, body)
        room = max(1, router.max_model_len - len(ids))
        params = body.sampling_params(default_max_tokens(router, room), router.tokenizer.vocab_size)
        return await serve(router, request, body, [ids], params, lora)

    # Declared here for /openapi.json (and served by FastAPI only if the fast lane is bypassed).
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completions_handler(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_handler(body, request)

    lane = FastLane(app, {"/v1/completions": (CompletionRequest, completions_handler),
                          "/v1/chat/completions": (ChatCompletionRequest, chat_handler)},
                    router.config.max_body_bytes)
    served = ApiKeyGate(lane, router.api_keys) if router.api_keys else lane
    if not router.config.allowed_origins:
        return served
    # Outermost, so that a browser's preflight (an OPTIONS without the API key) is answered before the key gate.
    return CORSMiddleware(served, allow_origins=router.config.allowed_origins, allow_methods=["GET", "POST"],
                          allow_headers=["*"], expose_headers=["Retry-After", REQUEST_ID_HEADER])


async def tokenize(router, text: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids. Tokenizing grows with the prompt (benchmarks/router.py times the tokenizer alone
    on its long prompts), and held on the event loop it delays every other request. A long text goes to a thread
    instead: the tokenizer's native part releases the GIL (Tokenizer.encode), so the loop serves other requests
    meanwhile. A short one is tokenized in place, sparing the hand-off (tokenize_in_thread_chars;
    benchmarks/router.py times both ways on long prompts)."""
    if len(text) < router.config.tokenize_in_thread_chars:
        return router.tokenizer.encode(text, add_special_tokens)
    return await asyncio.get_running_loop().run_in_executor(router.tokenize_pool, router.tokenizer.encode, text,
                                                            add_special_tokens)


# Conversations of at least this many messages are rendered off the event loop (chat_prompt_ids).
LONG_CONVERSATION_MESSAGES = 64


async def chat_prompt_ids(router, body: ChatPrompt, add_special_tokens: bool = False) -> list[int]:
    """The conversation's prompt ids (a chat completion's, or one /tokenize is asked about): rendered by the chat
    template, then tokenized (`tokenize`). A long one is rendered on the tokenizer threads too: the template is
    Python and holds the GIL, but there it leaves the loop a turn every switch interval (5 ms) rather than none for
    its whole render, which grows with the messages (a robustness-testing helper held every other request of the
    router back with one conversation of thousands)."""
    if len(body.messages) < LONG_CONVERSATION_MESSAGES:
        return await tokenize(router, body.prompt_text(router.tokenizer), add_special_tokens)

    def render_and_encode() -> list[int]:
        return router.tokenizer.encode(body.prompt_text(router.tokenizer), add_special_tokens)

    return await asyncio.get_running_loop().run_in_executor(router.tokenize_pool, render_and_encode)


def default_max_tokens(router, wanted: int) -> int:
    """max_tokens for a request that names none: `wanted`, within --max-output-tokens. The cap refuses what a
    client asks for; it must not refuse a request for a default the server chose."""
    cap = router.config.max_output_tokens
    return min(wanted, cap) if cap else wanted


async def serve(router, request: Request, body: CompletionRequest | ChatCompletionRequest,
                prompts: list[list[int]], params: SamplingParams, lora: str | None = None):
    """Admits every choice of the request (or none: a refused one releases the others), dispatches them and
    answers with their merged stream or body (tandem.openai.choices; one choice, the usual case, is not merged)."""
    await check_request(body, prompts, params, router.max_model_len)
    choices = request_choices(body, prompts, params, lora or router.served_name, router.tokenizer)
    queue_size = router.admission.queue.max_size
    if len(choices) > queue_size:  # they could never all be queued at once
        raise APIError(400, f"{len(choices)} completions in one request exceed this router's admission queue "
                            f"({queue_size}, --max-queue)", param="n")
    key = bearer_token(request.scope["headers"])
    slo_name = slo_class_of(router, request, key)
    if not router.decode.healthy():  # said now, with a status, rather than in an error event after a 200
        router.metrics.by_class(router.metrics.rejections, slo_name, reason="no_workers").inc()
        raise no_workers(router.config.health_interval_s)
    plans = [router.orchestrator.plan(ids, lora) for ids in prompts]  # (block hashes, routing key), shared by samples
    tickets, paths = admit_choices(router, body, choices, prompts, params, plans, slo_name, key)
    bill = Bill(router.admission, tickets[choices[0].request_id], choices)
    streams = staggered(choices, body.n, lambda c, after: dispatch(
        router, c.request_id, c.prompt_ids, c.params, tickets[c.request_id], slo_name, plans[c.prompt],
        coalesce=not body.stream, after=after, bill=bill, lora=lora,
        disagg=paths[c.prompt] if c.sample == 0 else None))  # later samples: computed from the first's cache
    fmt, deltas = combined(choices, body.n, streams)

    def forget() -> None:
        # The choices are admitted (queued) from here on. `deltas` gives them back when they run and end, but a
        # response whose client leaves before its body begins never runs them: forgotten here then, or never.
        for choice in choices:
            router.dispatcher.abandon(choice.request_id)
        bill.settle_unstarted()

    if body.stream:
        return EventStreamResponse(openai_stream(fmt, deltas, body.usage_in_stream, stream_error_body),
                                   on_close=forget)
    return await whole_answer(request, fmt, deltas, forget)


def slo_class_of(router, request: Request, key: str | None) -> str:
    """The request's SLO class: its API key's, else its header's, else interactive. A key's class is the
    operator's decision for that tenant: the header chooses only for callers without one."""
    slo_name = router.slo_for_key.get(key or "") or header_value(request.scope["headers"], SLO_HEADER_RAW) \
        or "interactive"
    if slo_name not in router.admission.slo_classes:
        raise APIError(400, f"unknown SLO class {slo_name!r}; known: {sorted(router.admission.slo_classes)}",
                       param=SLO_HEADER)
    return slo_name


def admit_choices(router, body, choices, prompts: list[list[int]], params: SamplingParams, plans, slo_name: str,
                  key: str | None) -> tuple[dict, list]:
    """Each choice's admission ticket (by request id) and each prompt's path (disaggregated or not); a refusal
    withdraws the tickets already taken and raises (docs/admission.md: what a request is charged)."""
    # Several choices: the first is charged for the whole request (the others nothing), so that the tenant's
    # bucket is checked and taken once, with each prompt counted once as usage counts it.
    whole = sum(map(len, prompts)) + params.max_tokens * len(choices)
    # The prompt tokens each prompt's first sample will compute (a prompt's later samples prefill from its cache);
    # the prefix expected cached is the pool's that computes it: its path is chosen first.
    paths, uncached = [], []
    for ids, (hashes, _) in zip(prompts, plans, strict=True):
        colocated = uncached_tokens(router, router.decode, ids, hashes, params)
        paths.append(choose_path(router, len(ids), colocated, params))
        uncached.append(uncached_tokens(router, router.prefill, ids, hashes, params) if paths[-1] else colocated)
    # Each prompt's first sample's prefill, predicted; the request's first choice is judged on all of them.
    seconds = [prefill_time(router, len(ids), new, path) for ids, new, path in zip(prompts, uncached, paths, strict=True)]
    whole_s = None if None in seconds else sum(seconds)
    tickets = {}
    try:
        for choice in choices:
            first, own = choice is choices[0], choice.sample == 0
            charge = None if len(choices) == 1 else whole if first else 0
            tickets[choice.request_id] = admit(
                router, choice, uncached[choice.prompt] if own else 0, seconds[choice.prompt] if own else 0.0,
                (sum(uncached), whole_s) if first else None, paths[choice.prompt], slo_name, key, charge,
                body.prompt_param)
    except BaseException:
        for request_id in tickets:
            router.dispatcher.withdraw(request_id)
        raise
    return tickets, paths


async def whole_answer(request: Request, fmt, deltas, forget) -> Response:
    """A non-streamed answer: its deltas gathered into one body, or 499 when the client leaves first."""
    complete = False
    try:
        async with CancelOnDisconnect(request.receive):
            async for delta in deltas:
                fmt.add(delta)
                if delta.finished:
                    complete = True
                    break
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: uvicorn drops it
    finally:
        if not complete:
            await deltas.aclose()
            forget()

    async def finish() -> None:
        # The answer is whole: the rest of its stream (the pools and the router's accounting closing it) runs once
        # the answer is sent, so that the client does not wait for it. On a worker's channel nothing in it waits on
        # the worker; over HTTP (--worker-transport http) it reads the stream's end.
        try:
            async for _ in deltas:
                pass
        except Exception:  # the client has its whole answer: a failure now is the router's to log, not to send
            log.exception("closing the stream of an answer already sent failed")
        finally:
            await deltas.aclose()
            forget()

    # Already plain JSON types: a response object skips FastAPI's recursive jsonable_encoder pass. Its `background`
    # is awaited once the body is sent: `finish` itself, without a starlette BackgroundTask around it.
    return FastJSONResponse(fmt.final(), background=finish)


def uncached_tokens(router, pool, ids: list[int], hashes: list[int], params: SamplingParams) -> int:
    """The prompt tokens a worker of `pool` is expected to compute: all but the longest prefix the router expects one
    of them to hold (all of them when prompt logprobs are asked)."""
    if params.prompt_logprobs is not None:
        return len(ids)
    return len(ids) - router.orchestrator.predictor.best_hit_tokens([w.url for w in pool.healthy()], hashes, len(ids))


def choose_path(router, prompt_len: int, uncached: int, params: SamplingParams) -> bool:
    """True to send the prompt to the prefill pool, False to compute it where it decodes. Past --disagg-min-tokens
    it is disaggregated; a shorter one too when computing it on the decode pool would stall the streams decoding
    there past the tightest inter-token target among this router's streams (docs/admission.md)."""
    if router.orchestrator.disaggregates(prompt_len, params):
        return True
    if params.prompt_logprobs is not None or not router.admission.enabled or not router.prefill.healthy():
        return False
    tightest = router.dispatcher.tightest_itl_s()
    if tightest is None:
        return False
    stall = colocated_stall_s(router.decode.healthy(), uncached, prompt_len)
    return stall is not None and stall > tightest * (1 - router.admission.headroom)


def prefill_time(router, prompt_len: int, uncached: int, disagg: bool) -> float | None:
    """A prompt's predicted prefill seconds on the pool that computes it (tandem.router.admission.prediction)."""
    return prefill_s((router.prefill if disagg else router.decode).healthy(), uncached, prompt_len, not disagg)


def admit(router, choice: Choice, uncached: int, own_s: float | None, request: tuple[int, float | None] | None,
          disagg: bool, slo_name: str, key: str | None, charge: int | None, prompt_param: str):
    """The admission ticket of one choice, or the 429 (or 400 past a cap) that refuses it. `uncached` and `own_s`:
    the prompt tokens it will compute and their predicted seconds (none for a prompt's later samples, which prefill
    from its first's cache: tandem.openai.choices). `request`: for a request's first choice, (tokens, seconds) all
    its prompts will compute (the request is judged as one); None for the others, which are not refused for the
    wait (AdmissionRequest.checks_ttft). `disagg`: its path (choose_path). `charge`: AdmissionRequest.charge_tokens."""
    decision = router.admission.decide(AdmissionRequest(
        choice.request_id, len(choice.prompt_ids), choice.params.max_tokens, slo_name, key,
        uncached_prompt_tokens=uncached, charge_tokens=charge, checks_ttft=request is not None,
        ignore_eos=choice.params.ignore_eos or choice.params.min_tokens >= choice.params.max_tokens,
        request_prefill_tokens=None if request is None else request[0], pool="prefill" if disagg else "decode",
        prefill_s=own_s, request_prefill_s=None if request is None else request[1]))
    if isinstance(decision, Reject):
        router.metrics.by_class(router.metrics.rejections, slo_name, reason=decision.reason.value).inc()
        caps = {RejectReason.INPUT_TOO_LONG: prompt_param, RejectReason.MAX_TOKENS_TOO_LARGE: "max_tokens"}
        headers = retry_after(decision.retry_after_s) if decision.retry_after_s is not None else {}
        raise APIError(400 if decision.reason in caps else 429, decision.message, param=caps.get(decision.reason),
                       code=decision.reason.value, headers=headers)
    return decision


async def dispatch(router, rid: str, ids: list[int], params: SamplingParams, ticket, slo_name: str, plan=None,
                   coalesce: bool = False, after: asyncio.Event | None = None, *, bill: Bill,
                   disagg: bool | None = None, lora: str | None = None):
    """Waits for the request's turn (EDF), runs it through the pools and records its SLO outcome. Inter-token
    latency is per token: a delta of k tokens after a gap g (coalesced, or from a worker that fell behind)
    is observed as g / k, and the request met its inter-token target when the largest of those did
    (docs/admission.md, "Goodput"). `after`: a later sample of a prompt waits for it once its turn came (holding
    its slot, not the queue's head, which every other request would wait behind). `disagg`: its path (choose_path)."""
    metrics, slo = router.metrics, ticket.slo
    ttft, itl = metrics.by_class(metrics.ttft, slo_name), metrics.by_class(metrics.itl, slo_name)
    try:
        await router.dispatcher.acquire(rid)
    except asyncio.CancelledError:  # its client left while it was queued (or a sibling failed): settled unstarted
        metrics.by_class(metrics.abandoned, slo_name).inc()
        raise
    bill.started.add(rid)
    held_from = time.monotonic()
    trace = Trace(lora=lora)
    arrival = ticket.arrival_s
    first_at = last_at = None
    worst_itl = 0.0  # the largest per-token gap between two deltas
    produced = 0  # tokens relayed, the first delta's included
    released = finished = failed = refused = False
    finish_reason = None
    try:
        if after is not None:
            await after.wait()
        async for delta in router.orchestrator.run(rid, ids, params, trace, plan, coalesce, disagg):
            t = time.monotonic()
            if first_at is None:
                first_at = t
                router.admission.release(rid)  # the prefill is done: it no longer loads the prefill pool
                released = True
                if trace.prefill_charged_seconds is not None:  # the worker time charged to it (pool.Worker)
                    router.admission.rates.record_prefill(max(trace.uncached_tokens, 1),
                                                          trace.prefill_charged_seconds)
                ttft.observe(t - arrival)
                router.admission.record_ttft(ticket, t - arrival)
            elif delta.new_token_ids:
                gap = (t - last_at) / len(delta.new_token_ids)
                worst_itl = max(worst_itl, gap)
                itl.observe(gap)
            produced += len(delta.new_token_ids)
            last_at = t
            finished, finish_reason = delta.finished, delta.finish_reason
            yield delta
    except Exception as exc:  # the pools could not answer it; a refusal of the request itself (400) is not that
        failed = not isinstance(exc, APIError) or exc.status >= 500
        refused = not failed
        raise
    finally:
        if not released:
            router.admission.release(rid)
        router.dispatcher.release(rid, time.monotonic() - held_from, slo_name)
        bill.settle(rid, first_at is not None, produced, failed=failed or refused)
        if failed:
            metrics.by_class(metrics.failed, slo_name).inc()
        elif refused:  # a worker's 4xx for the request itself: a refusal, counted where the router's own are
            metrics.by_class(metrics.rejections, slo_name, reason="worker_refused").inc()
        elif not finished:  # its client left (or the server stopped) before the end
            metrics.by_class(metrics.abandoned, slo_name).inc()
        elif finished:
            router.admission.rates.record_output(produced, stopped=finish_reason == "stop")
            metrics.by_class(metrics.e2e, slo_name).observe(last_at - arrival)
            metrics.by_class(metrics.requests, slo_name).inc()
            ttft_met, itl_met = first_at - arrival <= slo.ttft_s, worst_itl <= slo.itl_s
            for kind, met in (("ttft", ttft_met), ("itl", itl_met)):
                if not met:
                    metrics.by_class(metrics.slo_violations, slo_name, kind=kind).inc()
            if ttft_met and itl_met:
                metrics.by_class(metrics.goodput, slo_name).inc()
        if router.config.enable_log_requests:
            outcome = ("failed" if failed else "refused by a worker" if refused else
                       f"finished ({finish_reason})" if finished else "abandoned")
            log.info("%s %s: %d prompt tokens, %d output, class %s, %s path, prefill %s, decode %s, TTFT %s", rid,
                     outcome, len(ids), produced, slo_name, trace.path or "no", trace.prefill_worker or "-",
                     ",".join(trace.decode_workers) or "-",
                     f"{first_at - arrival:.3f} s" if first_at is not None else "-")


class Bill:
    """What a request's tenant pays for, settled choice by choice as each ends. Admission charged the request's first
    choice with the whole: every prompt once and every choice's max_tokens (serve). Each choice gives back the
    output tokens it did not make. A prompt's tokens go back when none of its samples had a first token, unless
    one was dispatched and then given up by a client that went away (the workers may have computed it); a choice
    that failed or was refused ends the request, and the others' ends are then not the client's doing. So a
    tenant's rate counts the tokens it was served: a request that ends short of max_tokens (a stop, EOS, a
    failure) is not billed for the rest."""

    def __init__(self, admission, ticket, choices: list[Choice]):
        self.admission = admission
        self.ticket = ticket  # the first choice's: it carries the charge (all choices are one tenant's)
        self.open = {c.request_id: c for c in choices}  # not settled yet
        self.started: set[str] = set()  # dispatched choices: they settle themselves when their dispatch ends
        self.failed = False  # a choice failed or was refused
        self.prompt_owed: dict[int, bool] = {}  # prompt -> served to one of its samples, or left being computed
        self.samples_open: dict[int, int] = {}  # prompt -> its samples not settled yet
        for choice in choices:
            self.samples_open[choice.prompt] = self.samples_open.get(choice.prompt, 0) + 1

    def settle(self, request_id: str, first_token: bool, produced: int, failed: bool) -> None:
        choice = self.open.pop(request_id, None)
        if choice is None:
            return
        self.failed = self.failed or failed
        left_computing = request_id in self.started and not self.failed
        owed = self.prompt_owed.get(choice.prompt, False) or first_token or left_computing
        self.prompt_owed[choice.prompt] = owed
        self.samples_open[choice.prompt] -= 1
        unmade = max(choice.params.max_tokens - produced, 0)
        if not self.samples_open[choice.prompt] and not owed:
            unmade += len(choice.prompt_ids)  # the prompt's last sample to end: nobody was served it
        if unmade:
            self.admission.refund(self.ticket, unmade)

    def settle_unstarted(self) -> None:
        """The choices never dispatched (the client left first, or a sibling failed): nothing was computed for them."""
        for request_id in [r for r in self.open if r not in self.started]:
            self.settle(request_id, False, 0, failed=False)


def stream_error_body(exc: Exception) -> dict | None:
    """The error event that ends a stream the pools cannot finish (see tandem.server.sse.openai_stream)."""
    return exc.body() if isinstance(exc, APIError) else None
