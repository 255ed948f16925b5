"""Carries one request through the worker pools and yields its deltas (docs/architecture.md).

  long prompt + a healthy prefill pool -> a prefill worker -> first token out at once -> a decode worker
      pulls the KV and streams
  short prompt, or no prefill worker   -> a decode worker alone
The routing policy (router/policies/) chooses each worker. Failures stay inside: a prefill that fails is retried
on another worker, then served colocated; a decode worker that dies mid-stream is replaced, resuming from
prompt + tokens sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from tandem.config import RouterConfig
from tandem.errors import APIError, retry_after
from tandem.hashing import adapter_seed, block_hashes
from tandem.metrics import RouterMetrics
from tandem.openai.formatting import Delta
from tandem.protocol import SamplingParams, join_decode_events
from tandem.router.lora_affinity import lacking_adapter
from tandem.router.policies.base import Placement
from tandem.router.policies.registry import make_policy
from tandem.router.policies.ring import routing_key
from tandem.router.pool import WorkerPool
from tandem.router.prefix_predictor import PrefixPredictor
from tandem.router.worker_client import TRANSPORT_ERRORS, UnreadableAnswer, WorkerClient, WorkerStatusError
from tandem.server.background import spawn
from tandem.server.request_id import current as client_request_id

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # per phase: a request survives two worker failures


def no_workers(health_interval_s: float) -> APIError:
    """503 for a request no decode worker can take now, with a Retry-After of the probe interval: the soonest
    a worker can be back in rotation."""
    return APIError(503, "no decode worker is available", code="no_workers", headers=retry_after(health_interval_s))


class WorkerFailure(Exception):
    """A worker could not serve its part; the orchestrator moves the request elsewhere."""


class _UnusableHandle(Exception):
    """A decode worker cannot read the prefill's KV handle (the pools' KV layouts differ)."""


KV_LAYOUT_MISMATCH = "kv_layout_mismatch"  # the code of a decode worker's refusal of such a handle


@dataclass
class Trace:
    """What happened to one request, for metrics and tests."""

    path: str = ""  # disagg | colocated
    migrations: int = 0
    prefill_worker: str | None = None
    decode_workers: list[str] = field(default_factory=list)
    predicted_hit_tokens: int = 0
    engine_hit_tokens: int = 0
    uncached_tokens: int = 0
    prefill_charged_seconds: float | None = None  # the worker time charged to its prefill (Worker.prefill_started)
    lora: str | None = None  # the LoRA adapter it is served with (None: the base model)


@dataclass
class DecodePhase:
    """One request's decode phase: what carries over from one decode worker to the next. `generated`: the tokens
    so far (the prefill's first, or none); `handle`: the prefill's KV handle (None: computed on the decode
    worker); `prompt_cached`: the prompt tokens the prefill worker found cached, which every delta reports (None:
    the first decode worker's count, which computes the prompt itself)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    hashes: list[int]
    key: int
    trace: Trace
    touched: set[tuple[str, str]]  # (worker, request id there): what to abort if the client leaves
    coalesce: bool
    generated: list[int] = field(default_factory=list)
    handle: dict | None = None
    prompt_cached: int | None = None
    attempt_id: str = ""  # the request's id on its current decode worker
    failed: dict[str, int] = field(default_factory=dict)  # url -> its `entered` when it failed this request
    failures: int = 0
    wait_until: float | None = None  # loop time the wait for a decode worker to come back ends
    migrating: bool = False
    finished: bool = False

    def __post_init__(self):
        self.attempt_id = self.attempt_id or self.rid


class Orchestrator:
    def __init__(self, config: RouterConfig, prefill: WorkerPool, decode: WorkerPool, http: WorkerClient,
                 metrics: RouterMetrics, hash_seed: int):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.http = http
        self.metrics = metrics
        self.hash_seed = hash_seed
        self.predictor = PrefixPredictor(config.block_size)
        self.policy = make_policy(config, self.predictor, metrics)
        self._layout_warned: set[tuple[str | None, str]] = set()  # (prefill, decode) workers whose layouts differ

    def plan(self, prompt: list[int], lora: str | None = None) -> tuple[list[int], int]:
        """(block hashes, routing key) of a prompt, seeded by its LoRA adapter as the workers' prefix caches are."""
        seed = adapter_seed(self.hash_seed, lora)
        hashes = block_hashes(prompt, self.config.block_size, seed)
        return hashes, routing_key(prompt, self.config.block_size, seed, self.config.routing_blocks, hashes)

    def disaggregates(self, prompt_len: int, params: SamplingParams) -> bool:
        """Whether a prompt goes to the prefill pool: long enough (--disagg-min-tokens), a prefill worker in rotation,
        and no prompt logprobs asked (they come from the worker that computes the whole prompt: colocated)."""
        return prompt_len >= self.config.disagg_min_tokens and bool(self.prefill.healthy()) \
            and params.prompt_logprobs is None

    async def run(self, rid: str, prompt: list[int], params: SamplingParams, trace: Trace,
                  plan: tuple[list[int], int] | None = None, coalesce: bool = False,
                  disagg: bool | None = None) -> AsyncIterator[Delta]:
        """`plan` is `self.plan(prompt)` when the caller already has it (hashing a prompt costs in proportion to
        its length). `coalesce` (a client that does not stream): the decode worker sends the first token
        at once and the rest as one delta at the end, not one event per token to read, parse and format. `disagg`:
        the path admission chose (None: `disaggregates`); a prefill pool left empty since serves it colocated."""
        hashes, key = plan if plan is not None else self.plan(prompt)
        disagg = self.disaggregates(len(prompt), params) if disagg is None else \
            disagg and bool(self.prefill.healthy()) and params.prompt_logprobs is None
        touched: set[tuple[str, str]] = set()  # (worker, request id there): what to abort if the client leaves
        finished = False
        try:
            if disagg:
                try:
                    pre, first = await self._prefill(rid, prompt, params, hashes, key, trace, touched)
                except WorkerFailure:
                    self._route("fallback")
                else:
                    self._route("disagg")
                    trace.path = "disagg"
                    first.num_cached_tokens = min(first.num_cached_tokens, len(prompt))
                    yield first
                    if first.finished:
                        finished = True
                        return
                    handed_over = False
                    phase = DecodePhase(rid, prompt, params, hashes, key, trace, touched, coalesce,
                                        [pre["first_token_id"]], pre["kv_handle"], first.num_cached_tokens)
                    async for delta in self._decode(phase):
                        if not handed_over:
                            # A decode worker answered: it has the handle and releases the lease itself, and the
                            # prefill worker is no longer told to abort (that would free blocks being pulled, a pull
                            # then wasted). Until then it is: a request given up while its decode call is still on
                            # its way (a connection being opened) would leave the blocks pinned to the lease's end.
                            touched.discard((trace.prefill_worker, rid))
                            handed_over = True
                        yield delta
                    finished = True
                    return
            trace.path = "colocated"
            if not disagg:  # a request that fell back is counted as that, not as colocated too
                self._route("colocated")
            async for delta in self._decode(DecodePhase(rid, prompt, params, hashes, key, trace, touched, coalesce)):
                yield delta
            finished = True
        finally:
            if not finished:  # the client left (or we failed): stop the work on every worker involved
                for url, request_id in touched:
                    spawn(self._abort(url, request_id))

    # -- prefill --------------------------------------------------------------------------
    async def _prefill(self, rid, prompt, params, hashes, key, trace: Trace, touched: set[tuple[str, str]]
                       ) -> tuple[dict, Delta]:
        """The prefill worker's answer, and its first token as the request's first delta."""
        tried: set[str] = set()
        for _ in range(MAX_ATTEMPTS):
            url = self._place(self.prefill, key, hashes, len(prompt), tried, trace)
            if url is None:
                break
            tried.add(url)
            touched.add((url, rid))
            weight = trace.uncached_tokens
            worker = self.prefill.workers[url]
            worker.prefill_tokens_in_flight += weight
            worker.in_flight += 1
            loop = asyncio.get_running_loop()
            mark, done = worker.prefill_started(loop.time()), False
            try:
                body = await self.http.post_json(url, "/internal/prefill", {
                    "request_id": rid, "prompt_token_ids": prompt, "sampling": params.model_dump(),
                    "client_request_id": client_request_id(), "lora_name": trace.lora})
                first = _first_delta(url, body)
                trace.prefill_charged_seconds, done = worker.prefill_done(loop.time(), mark), True
                self.prefill.record_success(url)
                trace.prefill_worker = url
                self._record_hits(trace, first.num_cached_tokens)
                return body, first
            except WorkerStatusError as exc:
                if 400 <= exc.status < 500:
                    raise APIError(exc.status, exc.message) from None
                self.prefill.record_failure(url)
            except TRANSPORT_ERRORS as exc:
                log.info("prefill on %s failed: %r", url, exc)
                self.prefill.record_failure(url)
                self._abandon(touched, url, rid)  # a worker that only stopped answering may still be at it
            finally:
                if not done:  # failed or abandoned: its share is charged to no one
                    worker.prefill_done(loop.time(), mark)
                worker.prefill_tokens_in_flight -= weight
                worker.in_flight -= 1
        raise WorkerFailure("no prefill worker could serve the request")

    # -- decode ---------------------------------------------------------------------------
    async def _decode(self, phase: DecodePhase) -> AsyncIterator[Delta]:
        """The decode phase's deltas, resumed on another worker when one fails (MAX_ATTEMPTS failures end it)."""
        while phase.failures < MAX_ATTEMPTS:
            url = await self._decode_worker(phase)
            try:
                async with aclosing(self._attempt(phase, url)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except _UnusableHandle as exc:
                self._recompute_unusable(phase, url, exc)
            except (*TRANSPORT_ERRORS, WorkerFailure) as exc:
                if phase.finished:  # only the end of a finished stream was lost: nothing to resume
                    self.decode.record_success(url)
                    return
                self._resume_elsewhere(phase, url, exc)
                if phase.generated and len(phase.generated) >= phase.params.max_tokens:
                    # Every token arrived, only the end that says so did not: said here, as the worker would have.
                    yield Delta([], "", None, True, "length", phase.prompt_cached or 0)
                    return
        raise APIError(503, "the request failed on every decode worker tried", code="decode_failed")

    async def _attempt(self, phase: DecodePhase, url: str) -> AsyncIterator[Delta]:
        """One decode worker's part: its deltas until the request finishes; raises when the worker fails it."""
        first_try = not phase.trace.decode_workers  # each attempt adds its worker there
        if phase.migrating:  # counted once it goes on: a request that found no worker to go on to was not migrated
            phase.migrating = False
            phase.trace.migrations += 1
            self._route("migrated")
        phase.touched.add((url, phase.attempt_id))
        phase.trace.decode_workers.append(url)
        prompt, params, trace = phase.prompt, phase.params, phase.trace
        colocated_weight = 0 if phase.handle is not None or not first_try else \
            len(prompt) if params.prompt_logprobs is not None else trace.uncached_tokens  # those compute it all
        worker = self.decode.workers[url]
        worker.prefill_tokens_in_flight += colocated_weight
        worker.in_flight += 1
        loop = asyncio.get_running_loop()
        prefilling = phase.handle is None  # it prefills here (colocated, or recomputing after a migration)
        mark = worker.prefill_started(loop.time()) if prefilling else 0.0
        try:
            try:
                # The events of one batch (what had arrived together) are relayed as one delta: a router that
                # falls behind relays several tokens for the cost of one (the client gets a chunk of several
                # tokens, as from an engine step that made several).
                async for batch in self.http.event_batches(url, "/internal/decode", _decode_body(phase)):
                    delta, error = _batch_delta(url, batch)
                    if delta is not None and not phase.finished:  # after a finish only the stream's end follows
                        if prefilling:  # its first delta: the prefill is done
                            charged, prefilling = worker.prefill_done(loop.time(), mark), False
                            if first_try:
                                trace.prefill_charged_seconds = charged
                        if colocated_weight:
                            worker.prefill_tokens_in_flight -= colocated_weight
                            colocated_weight = 0
                        phase.generated.extend(delta.new_token_ids)
                        if phase.prompt_cached is None:  # (a worker counts its cache over prompt + output so far)
                            phase.prompt_cached = min(delta.num_cached_tokens, len(prompt))
                        delta.num_cached_tokens = phase.prompt_cached
                        yield delta
                        phase.finished = delta.finished
                    if error is not None:
                        raise error
            except WorkerStatusError as exc:
                if phase.handle is not None and exc.code == KV_LAYOUT_MISMATCH:
                    raise _UnusableHandle(exc.message) from None
                raise _refusal(url, exc) from None
            if phase.finished:
                self.decode.record_success(url)
                return
            raise WorkerFailure(f"{url} ended the stream early")
        finally:
            if prefilling:
                worker.prefill_done(loop.time(), mark)
            worker.prefill_tokens_in_flight -= colocated_weight
            worker.in_flight -= 1

    async def _decode_worker(self, phase: DecodePhase) -> str:
        """The next decode worker for the phase. With none left in rotation (a pool of one restarting, a whole pool
        frozen for a moment) the request, its prompt computed and maybe tokens sent, waits a while for one to come
        back (one wait per phase, --worker-return-wait-s) rather than fail at once."""
        url = self._pick_decode(phase)
        while url is None:
            # Workers still in rotation that all failed this request are asked first: one that crashed leaves
            # rotation at this probe (a failure or two do not eject it), and is waited for; one that answers is
            # alive, and failed the request itself: it fails now.
            if self.decode.healthy():
                await asyncio.gather(*(self.decode.probe(w, timeout_s=1.0) for w in self.decode.healthy()))
            now = asyncio.get_running_loop().time()
            phase.wait_until = phase.wait_until or now + self.config.worker_return_wait_s
            if self.decode.healthy() or not await self.decode.wait_for_entry(phase.wait_until - now):
                log.warning("request %s: no decode worker came back within %g s (--worker-return-wait-s); it "
                            "ends with no_workers after %d tokens", phase.rid, self.config.worker_return_wait_s,
                            len(phase.generated))
                raise no_workers(self.config.health_interval_s)
            url = self._pick_decode(phase)
        return url

    def _recompute_unusable(self, phase: DecodePhase, url: str, exc: _UnusableHandle) -> None:
        """The pools disagree on the KV layout (a dtype or block size set for one pool only): no worker of this
        pool can read the handle. The prompt is computed here instead, as after a lost prefill (the worker that
        refused the handle released its lease), with no failure counted against the worker or the request's
        attempts. Said once per pair of workers."""
        pair = (phase.trace.prefill_worker, url)
        if pair not in self._layout_warned:
            self._layout_warned.add(pair)
            log.warning("decode worker %s cannot read the KV of prefill worker %s (%s): the prompts are computed "
                        "again on the decode pool; give both pools the same --dtype, --block-size and "
                        "--tensor-parallel-size", url, phase.trace.prefill_worker, exc)
        phase.handle = None
        self._route("fallback")

    def _resume_elsewhere(self, phase: DecodePhase, url: str, exc: Exception) -> None:
        """Books a decode worker's failure and sets the phase to resume on another worker, the KV now computed
        again from prompt + tokens so far."""
        others = any(w.url != url for w in self.decode.healthy())
        log.info("decode on %s failed (%r); request %s %s", url, exc, phase.rid,
                 "goes on another decode worker" if others else
                 f"waits up to {self.config.worker_return_wait_s:g} s for a decode worker to be back")
        self.decode.record_failure(url)
        self._abandon(phase.touched, url, phase.attempt_id)  # a worker that only stopped answering may still be at it
        phase.failed[url] = self.decode.workers[url].entered if url in self.decode.workers else 0
        phase.failures += 1
        if phase.handle is not None and phase.trace.prefill_worker is not None:
            # Nobody will use the prefill's blocks now: freed at once, not when the lease runs out (the failed
            # worker may never release it). One that was only hung and finishes its read later finds the lease
            # gone when it releases it, and does not use what it read (RemoteKV.release).
            spawn(self._abort(phase.trace.prefill_worker, phase.rid))
        phase.handle = None
        phase.migrating = True
        phase.attempt_id = f"{phase.rid}-m{phase.failures}"

    # -- placement ------------------------------------------------------------------------
    def _pick_decode(self, phase: DecodePhase) -> str | None:
        workers = self.decode.workers
        exclude = {u for u, entered in phase.failed.items() if u not in workers or workers[u].entered == entered}
        if phase.handle is not None:  # disaggregated: the policy's decode choice
            exclude |= lacking_adapter(self.decode, phase.trace.lora)
            return self.policy.pick_decode(self.decode, -(-len(phase.prompt) // self.config.block_size), exclude)
        # it prefills here: placed like a prefill, and by the sequences it will decode beside
        return self._place(self.decode, phase.key, phase.hashes, len(phase.prompt) + len(phase.generated), exclude,
                           phase.trace, decodes_here=True)

    def _place(self, pool: WorkerPool, key: int, hashes: list[int], prompt_len: int, exclude: set[str],
               trace: Trace, decodes_here: bool = False) -> str | None:
        """The policy's worker for computing a prompt, among the pool's healthy workers less `exclude`; the
        prefix it is predicted to find cached there goes to `trace`."""
        exclude = exclude | lacking_adapter(pool, trace.lora)
        url = self.policy.place(pool, Placement(key, hashes, prompt_len, exclude, decodes_here))
        if url is None:
            return None
        trace.predicted_hit_tokens = self.predictor.predicted_hit_tokens(url, hashes, prompt_len)
        trace.uncached_tokens = max(prompt_len - trace.predicted_hit_tokens, 1)
        self.predictor.record(url, hashes)
        self.metrics.plain(self.metrics.predicted_prefix_hit).inc(trace.predicted_hit_tokens)
        return url

    def _record_hits(self, trace: Trace, engine_hits: int) -> None:
        trace.engine_hit_tokens = engine_hits
        self.metrics.plain(self.metrics.engine_prefix_hit).inc(engine_hits)

    def _route(self, path: str) -> None:
        self.metrics.plain(self.metrics.routing, path=path).inc()

    def _abandon(self, touched: set[tuple[str, str]], url: str, request_id: str) -> None:
        """Stop an attempt given up on (a request retried or resumed elsewhere) now, not when the request ends."""
        touched.discard((url, request_id))
        spawn(self._abort(url, request_id))

    async def _abort(self, url: str, rid: str) -> None:
        try:
            await self.http.post_json(url, "/internal/abort", {"request_id": rid}, timeout_s=2.0)
        except (*TRANSPORT_ERRORS, WorkerStatusError):
            pass


class _Entry:
    __slots__ = ("token_id", "logprob", "top_logprobs")

    def __init__(self, d: dict):
        self.token_id, self.logprob = d["token_id"], d["logprob"]
        if type(self.token_id) is not int or not isinstance(self.logprob, (float, int)):  # formatted as such
            raise TypeError("a logprob entry's field of the wrong type")
        self.top_logprobs = [tuple(t) for t in d.get("top_logprobs", [])]


def _entry(d: dict) -> _Entry:
    return _Entry(d)


def _decode_body(phase: DecodePhase) -> dict:
    """The /internal/decode request of the phase's next attempt: after tokens were sent, the first of them (or
    all so far, after a migration) counts as output."""
    generated, params = phase.generated, phase.params
    body = {"request_id": phase.attempt_id, "sampling": params.model_dump(), "kv_handle": phase.handle,
            "prompt_token_ids": phase.prompt + generated[:-1] if generated else phase.prompt,
            "first_token_id": generated[-1] if generated else None, "coalesce_after_first": phase.coalesce,
            "client_request_id": client_request_id(), "lora_name": phase.trace.lora}
    if generated:
        body["sampling"]["max_tokens"] = params.max_tokens - len(generated) + 1
        body["sampling"]["prompt_logprobs"] = None  # the client has them from the first attempt
        if len(generated) > 1:
            body["output_tokens_in_prompt"] = len(generated) - 1
    return body


def decode_delta(chunks: list[dict]) -> Delta:
    """Consecutive decode events (tandem.protocol.DecodeChunk as JSON) as one delta."""
    event = join_decode_events(chunks)
    logprobs, prompt_logprobs = event.get("logprobs"), event.get("prompt_logprobs")
    return Delta(event["token_ids"], event.get("text", ""), [_entry(e) for e in logprobs] if logprobs else None,
                 event.get("finish_reason") is not None, event.get("finish_reason"), event.get("num_cached_tokens", 0),
                 None if prompt_logprobs is None else [e and _entry(e) for e in prompt_logprobs],
                 event.get("stop_reason"))


def _batch_delta(url: str, batch: list[dict]) -> tuple[Delta | None, Exception | None]:
    """A batch of decode events as one delta (None when an error comes first), and the error event that ends the
    stream, if one does: what came before the failure is the client's, and a resume continues after it.
    UnreadableAnswer for events without their fields."""
    try:
        for i, event in enumerate(batch):
            if "error" in event:
                return (_typed(decode_delta(batch[:i])) if i else None), _worker_error(event["error"])
        return _typed(decode_delta(batch)), None
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableAnswer(f"{url} sent a decode event without its fields: {exc!r}") from None


def _first_delta(url: str, answer: dict) -> Delta:
    """A prefill worker's answer's first token as a delta; UnreadableAnswer for an answer without its fields (the
    KV handle among them: a dict, or None when the prefill finished the request)."""
    try:
        logprob = answer.get("first_token_logprob")
        first = _typed(Delta([answer["first_token_id"]], answer["first_token_text"],
                             [_entry(logprob)] if logprob else None, answer["finish_reason"] is not None,
                             answer["finish_reason"], answer.get("num_cached_tokens", 0),
                             stop_reason=answer.get("stop_reason")))
        if not (answer["kv_handle"] is None or type(answer["kv_handle"]) is dict):
            raise TypeError(f"kv_handle is a {type(answer['kv_handle']).__name__}")
        return first
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableAnswer(f"{url} answered a prefill without its fields: {exc!r}") from None


def _typed(delta: Delta) -> Delta:
    """`delta`, after checking the types of what the request's bookkeeping and formatting use (TypeError)."""
    if not (type(delta.new_token_ids) is list and all(type(t) is int for t in delta.new_token_ids)
            and type(delta.new_text) is str and type(delta.num_cached_tokens) is int
            and (delta.finish_reason is None or type(delta.finish_reason) is str)
            and (delta.stop_reason is None or type(delta.stop_reason) in (int, str))):
        raise TypeError("a field of the wrong type")
    return delta


def _refusal(url: str, exc: WorkerStatusError) -> Exception:
    """A worker's non-200 answer to a decode: the request's own fault (4xx, for the client) or the worker's."""
    if 400 <= exc.status < 500:
        return APIError(exc.status, exc.message)
    return WorkerFailure(f"{url} answered {exc.status}")


def _worker_error(error) -> Exception:
    if not isinstance(error, dict):
        return WorkerFailure(f"worker error: {error!r}"[:500])
    if error.get("type") == "invalid_request_error":
        # The engine refused the request itself: the client's error, and no reason to try another worker or to
        # count it against this one.
        return APIError(400, error.get("message") or "invalid request", code=error.get("code"))
    return WorkerFailure(error.get("message", "worker error"))

