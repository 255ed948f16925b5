"""The P/D wire protocol on a worker (docs/architecture.md): prefill, decode, KV agent, lease release.

The router (or a test) drives it: POST /internal/prefill returns the first token and a kv handle;
POST /internal/decode with that handle pulls the blocks and streams the rest. A decode worker refuses a
handle whose layout differs from its own, and falls back to computing the prompt itself whenever the pull
cannot happen; the client never sees a transfer failure. The three calls a router makes (prefill, decode,
abort) also travel multiplexed on one WebSocket per router (tandem.workers.channel).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request

from tandem.errors import APIError, error_body
from tandem.openai.protocol import check_length, check_token_ids
from tandem.protocol import (
    AbortRequest,
    DecodeChunk,
    DecodeRequest,
    KVHandle,
    PrefillRequest,
    PrefillResponse,
    ReleaseRequest,
    TokenLogprob,
    join_decode_events,
)
from tandem.server.background import spawn
from tandem.server.json_response import FastJSONResponse
from tandem.server.request_id import use as use_request_id
from tandem.server.sse import DONE, EventStreamResponse, sse_event
from tandem.workers.async_engine import EngineDeadError
from tandem.workers.channel import add_channel_route, notify_all
from tandem.workers.engine.llm_engine import RemoteKV, RequestOutput
from tandem.workers.lora_routes import resolve_lora
from tandem.workers.request_checks import parse_body

log = logging.getLogger(__name__)


class AgentDirectory:
    """Caches peers' KV agent descriptions (GET /internal/kv/agent), keyed by the agent name in the
    handle: a prefill worker that restarted has a new name and is looked up afresh."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float = 2.0):
        self.client = client
        self.timeout_s = timeout_s
        self._agents: dict[str, dict] = {}

    async def get(self, handle: KVHandle) -> dict | None:
        if handle.agent_name in self._agents:
            return self._agents[handle.agent_name]
        try:
            r = await self.client.get(f"{handle.source_url}/internal/kv/agent", timeout=self.timeout_s)
            agent = r.json()["agent"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            agent = None
        if agent is None or agent.get("agent_name") != handle.agent_name:
            return None
        self._agents[handle.agent_name] = agent
        return agent


def logprob_entry(entry) -> TokenLogprob:
    return TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, top_logprobs=list(entry.top_logprobs))


def require_role(ctx, wanted: str) -> None:
    if ctx.config.role not in (wanted, "both"):
        raise APIError(400, f"this is a {ctx.config.role} worker; /internal/{wanted} is served by "
                            f"{wanted} and both workers", code="wrong_role")


def add_internal_routes(app: FastAPI, ctx) -> None:
    @app.get("/internal/kv/agent")
    async def kv_agent():
        if ctx.kv_transfer is None:
            raise APIError(503, "this worker has no KV transfer backend")
        return {"agent": ctx.kv_transfer.agent_info(), "layout": ctx.layout.model_dump()}

    @app.get("/internal/load")
    async def load():
        """What the router's placement and admission read: free KV blocks, queue lengths, limits and the step cost
        model (tandem.step_cost)."""
        engine = ctx.engine.engine
        cost = engine.step_costs.cost()
        return {"role": ctx.config.role, "free_blocks": engine.num_kv_blocks_total - engine.num_kv_blocks_used,
                "total_blocks": engine.num_kv_blocks_total, "running": engine.num_running,
                "waiting": engine.num_waiting, "in_flight": ctx.engine.num_in_flight,
                "max_model_len": ctx.max_model_len, "max_num_seqs": engine.config.max_num_seqs,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "context_tokens": engine.num_running_context_tokens,
                "step_cost": None if cost is None else cost.to_dict(), "step_tail": engine.step_tail.factor,
                "kv_pull_s": engine.mean_pull_s, "lora_adapters": [] if engine.lora is None else engine.lora.names}

    @app.post("/internal/drain")
    async def drain():
        """Scale-down: stop being ready (routers stop dispatching here within one probe interval)
        while requests in flight run to completion. `tandem drain` calls this from the preStop hook."""
        await start_draining(ctx)
        return {"draining": True, "in_flight": ctx.engine.num_in_flight}

    @app.post("/internal/abort")
    async def abort(request: Request):
        return await serve_abort(ctx, await parse_body(request, AbortRequest))

    @app.post("/internal/kv/release")
    async def kv_release(request: Request):
        body: ReleaseRequest = await parse_body(request, ReleaseRequest)
        if not await release_own_lease(ctx, body.lease_id, body.after_read):
            raise APIError(404, f"lease {body.lease_id} is unknown, already released or expired",
                           param="lease_id", code="lease_not_found")
        return {"released": True}

    @app.post("/internal/prefill")
    async def prefill(request: Request):
        answer = await serve_prefill(ctx, await parse_body(request, PrefillRequest))
        handle = answer["kv_handle"]
        if handle is not None and await request.is_disconnected():
            # Its caller gave up while it ran, and nobody will read the handle. (Over HTTP the router's abort travels
            # on another connection, and can come before the prefill reaches the engine, where it finds nothing.)
            await release_own_lease(ctx, handle["lease_id"])
        return FastJSONResponse(answer)

    @app.post("/internal/decode")
    async def decode(request: Request):
        events = await serve_decode(ctx, await parse_body(request, DecodeRequest))
        # For an answer whose body never began (its headers' send failed, or its streamer was cancelled first):
        # a body that began releases the lease itself (decode_events).
        return EventStreamResponse(sse_stream(events), on_close=events.close_unstarted)

    ctx.channel_answering = add_channel_route(app, connections=ctx.channel_connections, routes={
        "/internal/prefill": (PrefillRequest, lambda body: serve_prefill(ctx, body)),
        "/internal/decode": (DecodeRequest, lambda body: serve_decode(ctx, body)),
        "/internal/abort": (AbortRequest, lambda body: serve_abort(ctx, body)),
    })


async def start_draining(ctx) -> None:
    """Out of rotation: /ready answers 503 from now on, and the routers on a channel are told at once."""
    if not ctx.draining:
        ctx.draining = True
        await notify_all(ctx.channel_connections, "draining")


async def serve_abort(ctx, body: AbortRequest) -> dict:
    """The client went away: drop the request here too (unknown ids are fine)."""
    ctx.engine.abort(body.request_id)
    return {"aborted": body.request_id}


async def serve_prefill(ctx, body: PrefillRequest) -> dict:
    """The first token and a handle on the prompt's KV blocks, leased for a decode worker to pull."""
    use_request_id(body.client_request_id)
    require_role(ctx, "prefill")
    check_token_ids(ctx.tokenizer.vocab_size, body.prompt_token_ids)
    check_length(ctx.max_model_len, len(body.prompt_token_ids), body.sampling, "prompt_token_ids")
    if ctx.kv_transfer is None:
        raise APIError(503, "this worker has no KV transfer backend; it cannot serve prefills")
    lora = resolve_lora(ctx, body.lora_name)
    outputs = ctx.engine.generate(body.request_id, body.prompt_token_ids, body.sampling, time.monotonic(),
                                  prefill_only=True, lora=lora)
    last: RequestOutput | None = None
    try:
        async for out in outputs:
            last = out
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    finally:
        await outputs.aclose()
    if last is None or not last.new_token_ids:
        raise APIError(503, "the prefill was aborted")
    if ctx.config.enable_log_requests:
        log.info("prefill %s: %d prompt tokens, %d cached", body.request_id, len(body.prompt_token_ids),
                 last.num_cached_tokens)
    handle = None
    if last.kv_lease is not None:
        lease = last.kv_lease
        handle = KVHandle(source_url=ctx.advertise_url, agent_name=ctx.kv_transfer.agent_name,
                          lease_id=lease.lease_id, block_ids=lease.block_ids, num_tokens=lease.num_tokens,
                          layout=ctx.layout, expires_at=lease.expires_at, lora_name=lora)
    return PrefillResponse(
        request_id=body.request_id, first_token_id=last.new_token_ids[0], first_token_text=last.new_text,
        first_token_logprob=logprob_entry(last.new_logprobs[0]) if last.new_logprobs else None,
        finish_reason=last.finish_reason, stop_reason=last.stop_reason, kv_handle=handle, num_cached_tokens=last.num_cached_tokens,
    ).model_dump()


async def serve_decode(ctx, body: DecodeRequest) -> DecodeStream:
    """The request's decode events (see decode_events), once the request is checked (an APIError before any
    event) and its KV source is known: pulled from the prefill worker's handle, or computed here.

    The handle's lease is this request's to release from the moment it arrives: a request refused, or given up
    by its caller (cancelled) before its events begin, frees the prompt's blocks on the prefill worker at once.
    Left to the lease's expiry, they would stay pinned there for its whole TTL, every such request's."""
    use_request_id(body.client_request_id)
    handle = body.kv_handle
    try:
        require_role(ctx, "decode")
        lora = resolve_lora(ctx, body.lora_name)
        check_token_ids(ctx.tokenizer.vocab_size, body.prompt_token_ids)
        check_length(ctx.max_model_len, len(body.prompt_token_ids), body.sampling, "prompt_token_ids")
        kv_source, fallback = None, None
        if handle is not None:
            check_handle(ctx, body, handle)
            # Shielded: a fetch cut short by this request's cancel would leave the agent unknown, and the next
            # request from that prefill worker would wait on it again.
            agent = await asyncio.shield(ctx.agents.get(handle))
            if agent is None:
                fallback = "agent_unreachable"
                ctx.metrics.fallback(fallback)
            else:
                kv_source = RemoteKV(agent, handle.block_ids, handle.expires_at,
                                     release=release_after_read(ctx, handle, asyncio.get_running_loop()),
                                     lease_id=handle.lease_id)
    except BaseException:
        if handle is not None:
            spawn(release_lease(ctx, handle))
        raise
    if ctx.config.enable_log_requests:
        log.info("decode %s: %d prompt tokens, KV %s", body.request_id, len(body.prompt_token_ids),
                 f"from {handle.source_url}" if kv_source is not None else "computed here")
    options = {"first_token_id": body.first_token_id, "kv_source": kv_source,
               "output_tokens_in_prompt": body.output_tokens_in_prompt, "lora": lora}
    outputs = ctx.engine.generate(body.request_id, body.prompt_token_ids, body.sampling, time.monotonic(),
                                  **options)
    return DecodeStream(decode_events(ctx, outputs, handle, fallback, body.coalesce_after_first), ctx, handle)


class DecodeStream:
    """decode_events' (event, last) pairs. Once they have begun, decode_events releases the lease however they end;
    closing them before they began (close_unstarted, or aclose) releases it here: an async generator's cleanup
    runs only once it has started. They count as begun from the first __anext__ call, so read them with
    `async for` (as the channel and the SSE body do), which runs each awaitable it asks for."""

    def __init__(self, events: AsyncIterator[tuple[dict, bool]], ctx, handle: KVHandle | None):
        self._events = events
        self._ctx = ctx
        self._handle = handle
        self._started = False

    def __aiter__(self) -> DecodeStream:
        return self

    def __anext__(self):
        self._started = True
        return self._events.__anext__()

    def close_unstarted(self) -> None:
        if not self._started:
            self._started = True
            if self._handle is not None:
                spawn(release_lease(self._ctx, self._handle))

    async def aclose(self) -> None:
        self.close_unstarted()
        await self._events.aclose()


async def sse_stream(events: AsyncIterator[tuple[dict, bool]]) -> AsyncIterator[str]:
    """Decode events as /internal/decode's SSE body. [DONE] leaves in the same write as the last event: one
    send, and one wake-up of the reader, fewer."""
    async for payload, last in events:
        if last:
            yield sse_event(payload) + DONE
            return
        yield sse_event(payload)
    yield DONE


def check_handle(ctx, body: DecodeRequest, handle: KVHandle) -> None:
    mismatches = handle.layout.mismatches(ctx.layout)
    if mismatches:
        raise APIError(400, "incompatible KV layout: " + "; ".join(mismatches), param="kv_handle.layout",
                       code="kv_layout_mismatch")
    if handle.lora_name != body.lora_name:
        raise APIError(400, f"the kv_handle's KV was computed with LoRA adapter {handle.lora_name!r}, the request "
                            f"asks for {body.lora_name!r}", param="kv_handle.lora_name", code="kv_layout_mismatch")
    if body.first_token_id is None:
        raise APIError(400, "a kv_handle needs the first_token_id the prefill sampled", param="first_token_id")
    if handle.num_tokens != len(body.prompt_token_ids):
        raise APIError(400, f"the kv_handle covers {handle.num_tokens} tokens but the prompt has "
                            f"{len(body.prompt_token_ids)}", param="kv_handle.num_tokens")
    block_size = ctx.layout.block_size
    if len(handle.block_ids) != -(-handle.num_tokens // block_size):
        raise APIError(400, f"the kv_handle lists {len(handle.block_ids)} blocks for {handle.num_tokens} tokens "
                            f"of block size {block_size}", param="kv_handle.block_ids")


RELEASE_ATTEMPTS = 3
RELEASE_TIMEOUT_S = 2.0  # the first try's; each later one waits longer


async def release_own_lease(ctx, lease_id: str, after_read: bool = False) -> bool:
    """Free the blocks of a lease this worker holds; False when it is unknown, already released or expired
    (LeaseTable.release: `after_read`)."""
    return await ctx.engine.call(lambda engine: engine.release_lease(lease_id, after_read))


async def release_lease(ctx, handle: KVHandle, after_read: bool = False) -> bool:
    """Tell the prefill worker it may free the blocks; True if the lease was still held until then (200), False if
    it was not (404: aborted or expired) or no answer came. `after_read`: sent by the pull whose read is over,
    whose repeated ask is answered as the first was (LeaseTable.release). A failed try is sent again: a try can
    fail without the worker being gone (a pooled keep-alive connection the prefill worker closed as it was
    reused; an answer later than the timeout, behind a long engine step there), and the blocks would otherwise
    stay pinned for the whole lease TTL. Best effort after that: the TTL covers the rest."""
    body = {"lease_id": handle.lease_id, "after_read": True} if after_read else {"lease_id": handle.lease_id}
    for attempt in range(1, RELEASE_ATTEMPTS + 1):
        try:
            # Longer each time (2, 4, 6 s): what outlasts the first is most often a long engine step there (a busy
            # CPU), and a pull that gets no answer at all throws away a read that was good.
            response = await ctx.http.post(f"{handle.source_url}/internal/kv/release", json=body,
                                           timeout=RELEASE_TIMEOUT_S * attempt)
            return response.status_code == 200
        except httpx.HTTPError as exc:
            if attempt == RELEASE_ATTEMPTS:
                log.info("could not release lease %s at %s: %r", handle.lease_id, handle.source_url, exc)  # a timeout's str is ""
                return False
            await asyncio.sleep(0.1 * attempt)
    return False


def release_after_read(ctx, handle: KVHandle, loop: asyncio.AbstractEventLoop):
    """RemoteKV.release: the lease released by this worker's event loop for the engine, which takes the request into
    its batch once the answer says the lease held (one round trip per pull, the price of knowing the blocks read
    were this prompt's)."""
    def release() -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(release_lease(ctx, handle, after_read=True), loop)
    return release


async def decode_events(ctx, outputs: AsyncIterator[RequestOutput], handle: KVHandle | None,
                        fallback: str | None, coalesce_after_first: bool = False
                        ) -> AsyncIterator[tuple[dict, bool]]:
    """(event, last) pairs: a DecodeChunk per engine output (or, coalescing, the first one and then the rest as
    one), and an error event when the engine fails. `last` marks the event that ends the stream; a stream the
    engine ends without a finished output ends with no event marked."""
    released = handle is None
    first = True
    held: list[dict] = []  # events after the first, when coalescing, until the last one
    try:
        async for out in outputs:
            if not released:  # the pull is over (done or failed) once the engine reports anything
                released = True
                if out.kv_status != "pulled":  # a pull that succeeded released the lease itself (RemoteKV.release)
                    spawn(release_lease(ctx, handle))
            event = DecodeChunk(token_ids=out.new_token_ids, text=out.new_text,
                                logprobs=[logprob_entry(e) for e in out.new_logprobs] if out.new_logprobs else None,
                                finish_reason=out.finish_reason if out.finished else None,
                                stop_reason=out.stop_reason,
                                num_cached_tokens=out.num_cached_tokens,
                                kv_source=(out.kv_status or fallback or ("local" if handle is None else None))
                                if first else None,
                                prompt_logprobs=None if out.prompt_logprobs is None else [
                                    None if e is None else logprob_entry(e) for e in out.prompt_logprobs],
                                ).model_dump(exclude_none=True)
            if coalesce_after_first and not first:
                held.append(event)
                if not out.finished:
                    continue
                event = join_decode_events(held)
                held = []
            first = False
            yield event, out.finished
            if out.finished:
                return
        if held:  # the engine ended without a finished output: still hand over what it made
            yield join_decode_events(held), False
    except (ValueError, EngineDeadError) as exc:
        if held:  # what was made before the failure: a resumed request continues after it
            yield join_decode_events(held), False
        yield error_body(503 if isinstance(exc, EngineDeadError) else 400, str(exc)), True
    finally:
        await outputs.aclose()
        if not released:
            spawn(release_lease(ctx, handle))
