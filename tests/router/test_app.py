"""The router app over ASGI with scripted workers: a client that leaves before its answer is complete (the work
stops on the workers and the router forgets the request, whatever point it had reached), a chat template that
refuses the conversation, no decode worker to serve."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import aiohttp
import httpx
import orjson
import pytest
from metric_values import metric_value

from tandem.config import RouterConfig
from tandem.errors import error_body
from tandem.router.admission import AdmissionRequest, RateLimit, TenantRateLimiter
from tandem.router.app import build_app
from tandem.router.main import Router

WORKER = "http://127.0.0.1:9"


class SlowWorker:
    """A decode worker that makes one token every 10 ms, and records what it made and which aborts it got."""

    def __init__(self):
        self.tokens_made = 0
        self.aborts: list[str] = []

    async def event_batches(self, worker: str, path: str, body: dict):
        for i in range(body["sampling"]["max_tokens"]):
            await asyncio.sleep(0.01)
            self.tokens_made += 1
            last = i == body["sampling"]["max_tokens"] - 1
            yield [{"token_ids": [100 + i], "text": "x", **({"finish_reason": "length"} if last else {})}]

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        self.aborts.append(payload["request_id"])
        return {"ok": True}

    async def get(self, url: str, timeout=None) -> httpx.Response:
        """A probe's answer: alive and ready (a worker that fails a request but still answers is not down)."""
        load = {"free_blocks": 100, "total_blocks": 100, "running": 0, "waiting": 0, "role": "decode"}
        return httpx.Response(200, json=load if url.endswith("/internal/load") else {"status": "ready"})


@pytest.fixture
def router_app():
    router = Router(RouterConfig(decode=[WORKER]))
    router.decode.set_members([WORKER])
    router.decode._set_healthy(router.decode.workers[WORKER], True)
    router.orchestrator.http = router.decode.http = worker = SlowWorker()
    return router, build_app(router), worker


def completion(max_tokens: int, stream: bool) -> bytes:
    return orjson.dumps({"model": "smollm2", "prompt": "Hello there", "max_tokens": max_tokens, "stream": stream})


async def call_and_leave(app, body: bytes, leave_after_s: float, send_blocks: bool = False) -> list[dict]:
    """One POST /v1/completions whose client disconnects after `leave_after_s`; with `send_blocks`, the
    server's writes wait (a full socket buffer) from the first one on."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if send_blocks:
            await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"x-tandem-slo-class", b"batch")]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    await asyncio.sleep(0.05)  # aborts are sent on their way
    return sent


def assert_forgotten(router) -> None:
    assert not len(router.admission.queue) and router.admission.in_flight_tokens == 0
    assert router.dispatcher.active == 0 and router.decode.workers[WORKER].in_flight == 0


def test_a_non_streamed_request_stops_when_its_client_leaves(router_app):
    router, app, worker = router_app
    asyncio.run(call_and_leave(app, completion(100, stream=False), leave_after_s=0.1))
    assert worker.tokens_made < 50, worker.tokens_made  # not the 100 it would make for nobody
    assert len(worker.aborts) == 1
    assert_forgotten(router)
    assert sample(router, "tandem_router_abandoned_requests_total", slo_class="batch") == 1
    assert sample(router, "tandem_router_requests_total") == sample(router, "tandem_router_failed_requests_total") == 0


def test_a_client_that_leaves_while_its_request_is_queued_is_counted_as_abandoned():
    """Admitted, then given up on before its turn came: one of the requests tandem_router_abandoned_requests_total
    counts (admitted, but the client left before the end), as one that leaves mid-answer is."""
    router = Router(RouterConfig(decode=[WORKER], max_in_flight=1))
    router.decode.set_members([WORKER])
    router.decode._set_healthy(router.decode.workers[WORKER], True)
    router.orchestrator.http = SlowWorker()
    app = build_app(router)

    async def one_runs_one_waits():
        running = asyncio.ensure_future(call_and_leave(app, completion(100, stream=False), leave_after_s=5))
        await asyncio.sleep(0.05)  # it holds the only dispatch slot for a second
        await call_and_leave(app, completion(20, stream=False), leave_after_s=0.05)  # noticed within 0.2 s
        assert len(router.admission.queue) == 0
        assert sample(router, "tandem_router_abandoned_requests_total", slo_class="batch") == 1
        await running

    asyncio.run(one_runs_one_waits())
    assert sample(router, "tandem_router_requests_total", slo_class="batch") == 1
    assert_forgotten(router)


def test_a_streamed_request_whose_client_leaves_before_the_body_begins_is_forgotten(router_app):
    """The client leaves while the response's first write still waits: the request never ran, and must not stay
    at the head of the queue, where every later request would wait behind it."""
    router, app, worker = router_app

    async def leave_then_ask_again():
        sent = await call_and_leave(app, completion(4, stream=True), leave_after_s=0.05, send_blocks=True)
        assert [m["type"] for m in sent] == ["http.response.start"]
        assert_forgotten(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            r = await client.post("/v1/completions", content=completion(4, stream=False),
                                  headers={"content-type": "application/json", "x-tandem-slo-class": "batch"})
            return r

    r = asyncio.run(leave_then_ask_again())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert worker.tokens_made == 4  # only the second request ran


def test_a_chat_template_that_refuses_the_conversation_is_a_400(router_app):
    """Templates such as Llama 2's raise_exception() when roles do not alternate: the client's error."""
    router, app, _ = router_app
    router.tokenizer.chat_template = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
                                      "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                                      "{{ m['content'] }}{% endfor %}")
    router.tokenizer._compiled_template = None

    async def chat():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": [{"role": "assistant", "content": "Hi"}]})

    r = asyncio.run(chat())
    assert r.status_code == 400, r.text
    assert "roles must alternate" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"


def test_with_no_decode_worker_a_stream_is_refused_with_503_before_it_starts(router_app):
    router, app, _ = router_app
    router.decode._set_healthy(router.decode.workers[WORKER], False)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/completions", content=completion(4, stream=True),
                                     headers={"content-type": "application/json"})

    r = asyncio.run(ask())
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    assert r.headers["retry-after"] == "1"  # the probe interval: the soonest a worker can be back
    assert sample(router, "tandem_router_rejections_total", reason="no_workers") == 1
    assert_forgotten(router)


def sample(router, name: str, **labels) -> float:
    return metric_value(router.metrics.registry, name, **labels)


class DyingWorker(SlowWorker):
    """Makes two tokens, then its connection breaks (a worker killed mid-stream), as every worker tried does."""

    async def event_batches(self, worker: str, path: str, body: dict):
        for i in range(2):
            await asyncio.sleep(0.01)
            yield [{"token_ids": [100 + i], "text": "x"}]
        raise aiohttp.ServerDisconnectedError("the worker went away")


def test_a_stream_that_fails_after_its_first_token_counts_as_failed_not_answered(router_app):
    router, app, _ = router_app
    router.orchestrator.http = DyingWorker()
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 8, "stream": True}, slo="batch")
    assert r.status_code == 200 and '"error"' in r.text  # the stream's end says it failed
    assert sample(router, "tandem_router_failed_requests_total", slo_class="batch") == 1
    assert sample(router, "tandem_router_requests_total") == 0
    assert sample(router, "tandem_router_goodput_requests_total") == 0
    router.orchestrator.http = SlowWorker()
    assert post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 3}, slo="batch").status_code == 200
    assert sample(router, "tandem_router_requests_total", slo_class="batch") == 1
    assert sample(router, "tandem_router_goodput_requests_total", slo_class="batch") == 1
    assert_forgotten(router)


class RefusingWorker(SlowWorker):
    """The engine refuses the request itself (invalid_request_error): the client's error, not the worker's."""

    async def event_batches(self, worker: str, path: str, body: dict):
        yield [error_body(400, "seed out of range")]


def test_a_request_the_engine_refuses_is_neither_failed_nor_answered(router_app):
    router, app, _ = router_app
    router.orchestrator.http = RefusingWorker()
    bucket = metered(router)
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 3}, slo="batch")
    assert r.status_code == 400 and "seed out of range" in r.text
    for ended in ("requests", "failed_requests", "abandoned_requests"):
        assert sample(router, f"tandem_router_{ended}_total") == 0, ended
    # Counted with the router's own refusals (it was counted nowhere: found by a metrics review helper).
    assert sample(router, "tandem_router_rejections_total", reason="worker_refused", slo_class="batch") == 1
    assert bucket.level == pytest.approx(1000, abs=0.01)  # nothing served: its tenant's charge given back
    assert_forgotten(router)


class DeadWorker(SlowWorker):
    """Its connection breaks before any token, as every worker tried does."""

    async def event_batches(self, worker: str, path: str, body: dict):
        raise aiohttp.ServerDisconnectedError("the worker went away")
        yield  # an async generator, as the real one is


def test_a_request_that_failed_before_any_token_gives_back_its_tenants_charge(router_app):
    router, app, _ = router_app
    router.orchestrator.http = DeadWorker()
    bucket = metered(router)
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 10}, slo="batch")
    assert r.status_code == 503, r.text
    assert sample(router, "tandem_router_failed_requests_total") == 1
    assert bucket.level == pytest.approx(1000, abs=0.01)  # charged for nothing served: given back
    assert_forgotten(router)


class FirstCallDies(SlowWorker):
    """Its first request's connection breaks before any token; the others are served."""

    async def event_batches(self, worker: str, path: str, body: dict):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 1:
            raise aiohttp.ServerDisconnectedError("the worker went away")
        async for batch in super().event_batches(worker, path, body):
            yield batch


class RaisesAfterItsEnd(SlowWorker):
    """Serves the request, then its stream raises (a bug's way to end) after the finishing event."""

    async def event_batches(self, worker: str, path: str, body: dict):
        async for batch in super().event_batches(worker, path, body):
            yield batch
        raise RuntimeError("after the end")


def test_a_failure_after_a_whole_answer_was_sent_is_logged_not_raised(router_app, caplog):
    router, app, _ = router_app
    router.orchestrator.http = RaisesAfterItsEnd()
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 3}, slo="batch")  # raises if the app did
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx", r.text
    assert "already sent failed" in caplog.text
    assert_forgotten(router)


def metered(router, burst: float = 1000):
    """Every caller's tenant limited to `burst` tokens (refilling at a negligible rate): its bucket, full."""
    router.admission.rate_limiter = TenantRateLimiter(default_limit=RateLimit(0.001, burst))
    return router.admission.rate_limiter.bucket("default")


def half_full_bucket(router):
    bucket = metered(router)
    bucket.consume(500)  # below full, so that a refund of too much shows (a full bucket caps it)
    return bucket


def test_a_failed_request_of_several_prompts_pays_only_for_the_tokens_it_made(router_app):
    router, app, _ = router_app
    router.orchestrator.http = FirstCallDies()
    bucket = half_full_bucket(router)
    prompts = [" ".join(["word"] * 20), " ".join(["other"] * 20)]
    r = post(app, {"model": "smollm2", "prompt": prompts, "max_tokens": 50}, slo="batch")
    assert r.status_code == 503, r.text  # one prompt's choice failed on the only worker: the request fails
    # Both prompts go back once (the other prompt's choice ended because the request failed, not because its client
    # left), and every output token not made: what stays charged is the few tokens the other made meanwhile.
    assert 500 - 5 <= bucket.level <= 500 + 0.01
    assert_forgotten(router)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_samples_of_a_refused_request_pay_nothing(router_app, stream):
    router, app, _ = router_app
    router.orchestrator.http = RefusingWorker()
    bucket = half_full_bucket(router)
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 50, "n": 2, "stream": stream},
             slo="batch")
    assert (r.status_code == 400) if not stream else ("seed out of range" in r.text), r.text
    assert bucket.level == pytest.approx(500, abs=0.01)
    assert_forgotten(router)


def test_a_client_that_leaves_while_waiting_for_a_dispatch_slot_pays_nothing(router_app):
    router, app, _ = router_app
    bucket = half_full_bucket(router)
    router.dispatcher.active = router.dispatcher.limit  # every slot held (by long streams, say)
    sent = asyncio.run(call_and_leave(app, completion(50, stream=True), leave_after_s=0.05))
    router.dispatcher.active = 0
    assert not any(m.get("status") == 200 and m["type"] == "http.response.start" for m in sent[1:])
    assert bucket.level == pytest.approx(500, abs=0.01)
    assert_forgotten(router)


def test_a_request_of_several_choices_over_the_burst_is_admitted_as_one_of_one_choice_is(router_app):
    """A charge over the bucket's whole burst is taken once the bucket is full (it goes into debt); the request's
    later choices, charged nothing, must not then be refused for the debt their first choice made."""
    router, app, _ = router_app
    metered(router, burst=60)
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 40, "n": 2}, slo="batch")
    assert r.status_code == 200, r.text
    assert_forgotten(router)


def test_a_client_that_leaves_before_its_first_token_pays_for_its_prompt_only(router_app):
    router, app, _ = router_app
    bucket = half_full_bucket(router)
    asyncio.run(call_and_leave(app, completion(50, stream=True), leave_after_s=0.002))  # streamed: noticed at once
    prompt_tokens = len(router.tokenizer.encode("Hello there"))
    assert bucket.level == pytest.approx(500 - prompt_tokens, abs=0.01)
    assert_forgotten(router)


def test_probes_answer_head_as_get(router_app):
    router, app, _ = router_app

    async def ask(method: str, path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return (await client.request(method, path)).status_code

    assert [asyncio.run(ask("HEAD", p)) for p in ("/health", "/ready")] == [200, 200]
    router.decode._set_healthy(router.decode.workers[WORKER], False)
    assert asyncio.run(ask("HEAD", "/ready")) == asyncio.run(ask("GET", "/ready")) == 503


class ShortWorker(SlowWorker):
    """Stops after three tokens (EOS), whatever max_tokens asked for; or, `dies`, breaks after them."""

    def __init__(self, dies: bool = False):
        super().__init__()
        self.dies = dies

    async def event_batches(self, worker: str, path: str, body: dict):
        for i in range(3):
            await asyncio.sleep(0.01)
            end = {"finish_reason": "stop"} if i == 2 and not self.dies else {}
            yield [{"token_ids": [100 + i], "text": "x", **end}]
        if self.dies:
            raise aiohttp.ServerDisconnectedError("the worker went away")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dies", [False, True], ids=["stops", "dies"])
def test_a_tenant_pays_for_the_output_tokens_it_was_served_not_for_max_tokens(router_app, stream, dies):
    router, app, _ = router_app
    router.orchestrator.http = ShortWorker(dies)
    bucket = metered(router)
    n = 1 if dies else 2  # a failure ends every sample's stream at once: the others would stop wherever they were
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 50, "stream": stream, "n": n},
             slo="batch")
    assert r.status_code == (503 if dies and not stream else 200), r.text
    assert ('"error"' in r.text) == dies
    prompt_tokens = len(router.tokenizer.encode("Hello there"))
    # Each sample made three tokens (then stopped, or its only worker broke) of the 50 it was charged for.
    assert bucket.level == pytest.approx(1000 - prompt_tokens - n * 3, abs=0.01)
    assert_forgotten(router)


def test_refusal_and_diversion_series_start_at_zero(router_app):
    """A rejections or diversions panel shows 0 rather than "no data" before the first event: each class's
    series for each reason, and each pool's diversions, exist from the start."""
    router, _, _ = router_app
    series = {(s.name, tuple(sorted(s.labels.items()))) for f in router.metrics.registry.collect() for s in f.samples}
    for slo_class in router.admission.slo_classes:
        for reason in ("queue_full", "slo_unmeetable", "rate_limited", "input_too_long", "no_workers"):
            labels = {"model": router.served_name, "pool": "router", "slo_class": slo_class, "reason": reason}
            assert ("tandem_router_rejections_total", tuple(sorted(labels.items()))) in series
    for role in ("prefill", "decode"):
        labels = {"model": router.served_name, "pool": "router", "role": role}
        assert ("tandem_router_overload_diversions_total", tuple(sorted(labels.items()))) in series


def test_queue_depth_is_the_requests_admitted_and_not_dispatched_by_class(router_app):
    router, _, _ = router_app
    for i, slo in enumerate(["batch", "batch", "interactive"]):
        router.admission.decide(AdmissionRequest(f"q-{i}", 1, 1, slo, charge_tokens=0))
    assert sample(router, "tandem_router_queue_depth", slo_class="batch") == 2
    assert sample(router, "tandem_router_queue_depth", slo_class="interactive") == 1
    router.admission.pop()  # dispatched: the earliest deadline, the interactive one
    assert sample(router, "tandem_router_queue_depth", slo_class="interactive") == 0


def test_an_api_keys_slo_class_is_not_overridden_by_the_header():
    router = Router(RouterConfig(decode=[WORKER], max_queue=4))
    router.decode.set_members([WORKER])
    router.decode._set_healthy(router.decode.workers[WORKER], True)
    router.orchestrator.http = SlowWorker()
    router.slo_for_key = {"sk-batch": "batch"}
    app = build_app(router)

    async def ask(headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/completions", headers=headers,
                                     json={"model": "smollm2", "prompt": "Hello there", "max_tokens": 1})

    assert asyncio.run(ask({"authorization": "Bearer sk-batch", "x-tandem-slo-class": "interactive"})).status_code == 200
    assert asyncio.run(ask({"x-tandem-slo-class": "interactive"})).status_code == 200  # no key: the header chooses
    assert sample(router, "tandem_router_requests_total", slo_class="batch") == 1
    assert sample(router, "tandem_router_requests_total", slo_class="interactive") == 1


def test_a_client_that_leaves_stops_every_choice(router_app):
    """n=3: three requests downstream; a client that leaves stops (and the router forgets) all three."""
    router, app, worker = router_app
    body = orjson.dumps({"model": "smollm2", "prompt": "Hello there", "max_tokens": 100, "n": 3, "stream": True})
    sent = asyncio.run(call_and_leave(app, body, leave_after_s=0.1))
    assert sent[0]["status"] == 200
    assert worker.tokens_made < 3 * 50, worker.tokens_made
    assert sorted(abort.rsplit("-", 1)[1] for abort in worker.aborts) == ["0", "1", "2"]  # each choice's own id
    assert_forgotten(router)


def test_one_refused_choice_refuses_the_request_and_releases_the_others():
    router = Router(RouterConfig(decode=[WORKER], max_input_tokens=8, max_output_tokens=16))
    router.decode.set_members([WORKER])
    router.decode._set_healthy(router.decode.workers[WORKER], True)
    router.orchestrator.http = worker = SlowWorker()
    app = build_app(router)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/completions", json={
                "model": "smollm2", "prompt": ["Hi", "Hi", "a prompt well past the eight tokens allowed here"]})

    r = asyncio.run(ask())
    assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_long", r.text
    assert r.json()["error"]["param"] == "prompt"  # the parameter to change, as OpenAI's errors name it
    assert worker.tokens_made == 0
    assert_forgotten(router)
    r = post(app, {"model": "smollm2", "prompt": "Hi", "max_tokens": 20}, slo="batch")  # over --max-output-tokens
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("max_tokens_too_large", "max_tokens"), r.text


def post(app, body: dict, slo: str = "interactive") -> httpx.Response:
    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/completions", json=body, headers={"x-tandem-slo-class": slo})
    return asyncio.run(ask())


def test_n_samples_count_their_prompt_once_and_start_after_the_first_token(router_app):
    """An idle router with a known prefill rate: one prompt's prefill fits the 1 s TTFT target, sixteen would not.
    The samples are admitted (their prompt is prefilled once), and the later ones start once the first has its
    first token, when the prompt is in the worker's cache."""
    router, app, worker = router_app
    router.admission.rates.record_prefill(100, 1.0)  # 100 tokens/s per worker
    prompt = " ".join(["word"] * 60)  # 60 tokens: 0.6 s alone, 9.6 s sixteen times over
    started: list[tuple[str, int]] = []
    batches = worker.event_batches

    async def recording(url, path, body):
        started.append((body["request_id"], worker.tokens_made))
        async for batch in batches(url, path, body):
            yield batch

    worker.event_batches = recording
    r = post(app, {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "n": 16})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16
    first = [rid for rid, _ in started if rid.endswith("-0")]
    assert started[0][0] == first[0] and all(made >= 1 for _, made in started[1:])  # after its first token
    assert_forgotten(router)


@pytest.mark.parametrize("body", [{"n": 2}, {"n": 3, "stream": True}, {"prompt_list": True}],
                         ids=["n=2", "n=3 streamed", "two prompts"])
def test_several_choices_of_a_prompt_are_judged_by_the_first_as_one_choice_is(router_app, body):
    """A prompt whose prefill fits the TTFT target alone is refused with other work ahead of it and admitted on an
    idle pool (nothing ahead), and so is a request of several choices of it (or of two such prompts, 0.81 s in all):
    the later ones are not refused for the wait their own first choice adds."""
    router, app, _ = router_app
    router.admission.rates.record_prefill(100, 1.0)  # 100 tokens/s per worker
    prompt = " ".join(["word"] * 40)  # 0.4 s of prefill alone: within the 1 s target
    request = {"model": "smollm2", "prompt": [prompt, prompt + " more"] if body.pop("prompt_list", False) else prompt,
               "max_tokens": 2, **body}
    router.admission.decide(AdmissionRequest("ahead", 80, 1, charge_tokens=0, pool="decode"))  # 0.8 s ahead (EDF)
    r = post(app, request)
    assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unmeetable", r.text
    assert len(router.admission.queue) == 1  # the other's place only: the refused request left nothing queued
    router.dispatcher.abandon("ahead")
    r = post(app, request)  # nothing ahead now
    assert r.status_code == 200, r.text
    assert_forgotten(router)


def test_a_request_of_several_prompts_is_judged_by_all_its_prefill(router_app):
    """With 0.2 s of work ahead and a 1 s target, one 30-token prompt (0.3 s) fits and three in one request (0.9 s)
    do not: a request cannot slip its later prompts past admission."""
    router, app, _ = router_app
    router.admission.rates.record_prefill(100, 1.0)  # 100 tokens/s per worker
    prompt = " ".join(["word"] * 30)
    router.admission.decide(AdmissionRequest("ahead", 20, 1, charge_tokens=0, pool="decode"))  # 0.2 s ahead
    r = post(app, {"model": "smollm2", "prompt": [prompt, prompt + " a", prompt + " b"], "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unmeetable", r.text
    # One prompt fits; it waits behind "ahead", so it is only checked for admission here, then taken back.
    assert router.admission.decide(AdmissionRequest("one", 31, 2, uncached_prompt_tokens=31, pool="decode")).__class__.__name__ \
        == "Admit"
    for rid in ("one", "ahead"):
        router.dispatcher.abandon(rid)
    assert_forgotten(router)


def test_a_refused_request_gives_back_what_its_tenant_was_charged():
    router = Router(RouterConfig(decode=[WORKER], max_queue=4))
    router.decode.set_members([WORKER])
    router.decode._set_healthy(router.decode.workers[WORKER], True)
    router.orchestrator.http = SlowWorker()
    bucket = metered(router)
    app = build_app(router)
    r = post(app, {"model": "smollm2", "prompt": ["Hello there", "Hi"], "max_tokens": 10, "n": 3})
    assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"], r.text  # 6 could never queue
    for i in range(2):  # two places of four taken by requests of others, still queued
        router.admission.decide(AdmissionRequest(f"other-{i}", 1, 1, "batch", charge_tokens=0))
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 10, "n": 3})  # the third: queue full
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert bucket.level == pytest.approx(1000, abs=0.01)  # charged for nothing: given back
    assert len(router.admission.queue) == 2  # the others' places only
    for i in range(2):
        router.dispatcher.abandon(f"other-{i}")
    assert_forgotten(router)
    r = post(app, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 10, "n": 2})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert bucket.level == pytest.approx(1000 - prompt_tokens - 2 * 10, abs=0.01)  # the prompt charged once


def test_browser_origins_get_cors_headers_only_when_allowed_and_before_the_key_gate():
    """A browser app calls the router from another origin: its preflight (OPTIONS, without the API key) must be
    answered, and the answer must name the origin. Off by default: no origin is let in unless configured."""
    def app_with(origins):
        router = Router(RouterConfig(decode=[WORKER], api_key=["sk-1"], allowed_origins=origins))
        router.decode.set_members([WORKER])
        router.decode._set_healthy(router.decode.workers[WORKER], True)
        router.orchestrator.http = SlowWorker()
        return build_app(router)

    async def ask(app, method, headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            body = {"model": "smollm2", "prompt": "Hello there", "max_tokens": 1} if method == "POST" else None
            return await client.request(method, "/v1/completions", headers=headers, json=body)

    origin = {"origin": "https://app.example"}
    preflight = {**origin, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    allowed = app_with(["https://app.example"])
    answer = asyncio.run(ask(allowed, "OPTIONS", preflight))
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    served = asyncio.run(ask(allowed, "POST", {**origin, "authorization": "Bearer sk-1",
                                               "x-tandem-slo-class": "batch"}))
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "https://app.example"
    refused = asyncio.run(ask(allowed, "POST", origin))  # the key is still asked for
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    other = asyncio.run(ask(allowed, "OPTIONS", {**preflight, "origin": "https://elsewhere.example"}))
    assert "access-control-allow-origin" not in other.headers
    closed = app_with([])
    assert "access-control-allow-origin" not in asyncio.run(ask(closed, "OPTIONS", preflight)).headers


def long_conversation() -> list[dict]:
    """Just long enough to be rendered off the event loop (router.app.LONG_CONVERSATION_MESSAGES)."""
    from tandem.router.app import LONG_CONVERSATION_MESSAGES

    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
            for i in range(LONG_CONVERSATION_MESSAGES + 1)]


@contextlib.contextmanager
def threads_rendering(request_class):
    """The names of the threads `request_class`'s chat template renders on meanwhile, in order."""
    rendered_on = []
    prompt_text = request_class.prompt_text

    def spying(self, tokenizer):
        rendered_on.append(threading.current_thread().name)
        return prompt_text(self, tokenizer)

    request_class.prompt_text = spying
    try:
        yield rendered_on
    finally:
        request_class.prompt_text = prompt_text


def test_a_long_conversation_is_rendered_off_the_event_loop_to_the_same_ids():
    """The chat template is Python: one conversation of thousands of messages held the router's loop (a
    robustness-testing helper's finding). From LONG_CONVERSATION_MESSAGES on it renders on the tokenizer threads, to the same ids."""
    from tandem.openai.chat import ChatCompletionRequest
    from tandem.router.app import chat_prompt_ids

    router = Router(RouterConfig(decode=[WORKER]))
    turns = long_conversation()
    short, long = (ChatCompletionRequest(model="smollm2", messages=m) for m in (turns[:2], turns))
    with threads_rendering(ChatCompletionRequest) as rendered_on:
        ids = [asyncio.run(chat_prompt_ids(router, body)) for body in (short, long)]
    assert rendered_on[0] == "MainThread" and rendered_on[1].startswith("tokenize")
    for body, got in zip((short, long), ids, strict=True):
        assert got == router.tokenizer.encode(body.prompt_text(router.tokenizer), False)


def test_the_routers_tokenize_renders_a_long_conversation_off_the_event_loop_too():
    """POST /tokenize with `messages` renders the chat template as chat completions do (it was rendered on the loop
    whatever its length), with the request's add_special_tokens."""
    from tandem.openai.tokenize_routes import TokenizeChatRequest

    router = Router(RouterConfig(decode=[WORKER]))
    app = build_app(router)
    turns = long_conversation()

    async def ask(special: bool) -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            r = await client.post("/tokenize", json={"messages": turns, "add_special_tokens": special})
            assert r.status_code == 200, r.text
            return r.json()

    with threads_rendering(TokenizeChatRequest) as rendered_on:
        plain, special = asyncio.run(ask(False)), asyncio.run(ask(True))
    assert all(name.startswith("tokenize") for name in rendered_on) and len(rendered_on) == 2, rendered_on
    text = TokenizeChatRequest(messages=turns).prompt_text(router.tokenizer)
    assert plain["tokens"] == router.tokenizer.encode(text, False)
    assert special["tokens"] == router.tokenizer.encode(text, True)



def test_a_prompt_whose_logprobs_are_asked_is_charged_all_of_it(router_app):
    """The engine computes such a prompt whole (its logprobs need every position's logits), cached prefix or not:
    admission's prediction counts all of it."""
    router, app, _ = router_app
    charged = []
    decide = router.admission.decide

    def recording(request):
        charged.append(request.prefill_tokens)
        return decide(request)

    router.admission.decide = recording
    prompt = " ".join(["word"] * 200)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            for extra in ({}, {}, {"echo": True, "logprobs": 1}):
                r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 2,
                                                               **extra})
                assert r.status_code == 200, r.text

    asyncio.run(ask())
    length = len(router.tokenizer.encode(prompt))
    assert charged[0] == length and charged[1] < length - 100, charged  # the second finds the first's prefix
    assert charged[2] == length


class StallingWorker(SlowWorker):
    """Ten tokens 10 ms apart, but for one wait of 250 ms before the sixth."""

    async def event_batches(self, worker: str, path: str, body: dict):
        for i in range(body["sampling"]["max_tokens"]):
            await asyncio.sleep(0.25 if i == 5 else 0.01)
            last = i == body["sampling"]["max_tokens"] - 1
            yield [{"token_ids": [100 + i], "text": "x", **({"finish_reason": "length"} if last else {})}]


def test_goodput_counts_a_request_only_when_its_worst_token_gap_met_the_itl_target(router_app):
    """The interactive class's ITL target is 100 ms. A stream whose tokens came 10 ms apart but for one 250 ms wait
    met it on average (34 ms a token) and missed it for a quarter of a second: not goodput, an ITL violation."""
    from metric_values import metric_value

    router, app, _ = router_app
    router.orchestrator.http = StallingWorker()
    r = post(app, {"model": "smollm2", "prompt": "Hello", "max_tokens": 10, "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text
    registry = router.metrics.registry
    labels = {"slo_class": "interactive"}
    assert metric_value(registry, "tandem_router_requests_total", **labels) == 1
    assert metric_value(registry, "tandem_router_goodput_requests_total", **labels) == 0
    assert metric_value(registry, "tandem_router_slo_violations_total", kind="itl", **labels) == 1
    assert metric_value(registry, "tandem_router_slo_violations_total", kind="ttft", **labels) == 0
    router.orchestrator.http = SlowWorker()  # steady 10 ms gaps: within both targets
    assert post(app, {"model": "smollm2", "prompt": "Hello", "max_tokens": 10, "stream": True}).status_code == 200
    assert metric_value(registry, "tandem_router_goodput_requests_total", **labels) == 1
