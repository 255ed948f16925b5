"""What the orchestrator makes of an error event inside a decode worker's stream: a request the engine
refused (invalid_request_error) is the client's 400 and leaves the worker healthy; anything else is the
worker's failure and the request moves to another worker."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from metric_values import metric_value

from tandem.config import RouterConfig
from tandem.errors import APIError, error_body
from tandem.metrics import RouterMetrics
from tandem.protocol import SamplingParams
from tandem.router.orchestrator import Orchestrator, Trace
from tandem.router.pool import RETURN_PROBE_S, Worker, WorkerPool
from tandem.router.worker_client import WorkerStatusError

GOOD = {"token_ids": [7], "text": "x", "finish_reason": "length"}
HANG = "hang"  # in a script: the worker's answer never comes


class ScriptedWorkers:
    """Stands in for WorkerClient: each decode worker answers its scripted chunks, each alone, or a list of chunks
    as one batch (events that arrived together)."""

    def __init__(self, script: dict[str, list[dict]]):
        self.script = script
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.aborts: list[tuple[str, str]] = []

    async def event_batches(self, worker: str, path: str, body: dict):
        assert path == "/internal/decode"
        self.calls.append(worker)
        self.bodies.append(body)
        for chunk in self.script[worker]:
            if isinstance(chunk, BaseException):  # the connection failing here
                raise chunk
            if chunk is HANG:  # the call not sent yet (a connection being opened), for as long as it takes
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            yield chunk if isinstance(chunk, list) else [chunk]

    async def get(self, url: str, timeout=None):
        """A probe's answer: alive and ready (a worker that fails a request but still answers is not down)."""
        import httpx

        load = {"free_blocks": 100, "total_blocks": 100, "running": 0, "waiting": 0, "role": "both"}
        return httpx.Response(200, json=load if url.endswith("/internal/load") else {"status": "ready"})

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        if path == "/internal/prefill":
            return {"request_id": payload["request_id"], "first_token_id": 6, "first_token_text": "w",
                    "finish_reason": None, "num_cached_tokens": 0, "kv_handle": {"lease_id": "lease-1"}}
        assert path == "/internal/abort"
        self.aborts.append((worker, payload["request_id"]))
        return {"ok": True}


def orchestrator_over(script: dict[str, list[dict]]) -> tuple[Orchestrator, WorkerPool, ScriptedWorkers]:
    metrics = RouterMetrics("test")
    http = ScriptedWorkers(script)
    decode = WorkerPool("decode", http, metrics)
    for url in script:
        decode.workers[url] = Worker(url, healthy=True)
        decode.ring.add(url)
    return Orchestrator(RouterConfig(), WorkerPool("prefill", http, metrics), decode, http, metrics, 0), decode, http


async def collect(orchestrator: Orchestrator, max_tokens: int = 1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace())]


def split_orchestrator(http, metrics_name: str, decode_urls=("http://d",)
                       ) -> tuple[Orchestrator, WorkerPool, WorkerPool, RouterMetrics]:
    """An orchestrator that splits every prompt: prefill worker http://p, decode workers `decode_urls`."""
    metrics = RouterMetrics(metrics_name)
    prefill, decode = WorkerPool("prefill", http, metrics), WorkerPool("decode", http, metrics)
    for pool, urls in ((prefill, ("http://p",)), (decode, decode_urls)):
        for url in urls:
            pool.workers[url] = Worker(url, healthy=True)
            pool.ring.add(url)
    return Orchestrator(RouterConfig(disagg_min_tokens=1), prefill, decode, http, metrics, 0), prefill, decode, metrics


def test_a_refused_request_is_the_clients_error_and_no_worker_failure():
    refused = error_body(400, "seed out of range")
    orchestrator, pool, http = orchestrator_over({"http://a": [refused], "http://b": [refused]})
    with pytest.raises(APIError) as caught:
        asyncio.run(collect(orchestrator))
    assert caught.value.status == 400 and "seed out of range" in str(caught.value.message)
    assert len(http.calls) == 1  # not retried elsewhere
    assert all(w.failures == 0 and w.healthy for w in pool.workers.values())


def test_a_worker_that_answers_a_status_refuses_the_request_on_4xx_and_fails_on_5xx():
    """A worker that answers the decode itself with an error status (not an event in its stream): a 4xx is the
    client's error, not retried and not counted against the worker; a 5xx moves the request to another worker."""

    orchestrator, pool, http = orchestrator_over({"http://a": [WorkerStatusError(400, "bad kv_handle")],
                                                  "http://b": [WorkerStatusError(400, "bad kv_handle")]})
    with pytest.raises(APIError) as caught:
        asyncio.run(collect(orchestrator))
    assert caught.value.status == 400 and caught.value.message == "bad kv_handle"
    assert len(http.calls) == 1 and all(w.failures == 0 and w.healthy for w in pool.workers.values())

    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first = orchestrator._place(pool, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    other = next(u for u in pool.workers if u != first)
    http.script[first], http.script[other] = [WorkerStatusError(503, "overloaded")], [GOOD]
    deltas = asyncio.run(collect(orchestrator))
    assert [d.new_token_ids for d in deltas] == [[7]] and http.calls == [first, other]
    assert pool.workers[first].failures == 1 and pool.workers[other].failures == 0


def test_a_worker_error_moves_the_request_and_counts_against_the_worker():
    broken = error_body(503, "engine died")
    orchestrator, pool, http = orchestrator_over({"http://a": [broken], "http://b": [broken]})
    first = orchestrator._place(pool, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    other = next(u for u in pool.workers if u != first)
    http.script[other] = [GOOD]  # the worker tried second answers properly
    deltas = asyncio.run(collect(orchestrator))
    assert [d.new_token_ids for d in deltas] == [[7]]
    assert http.calls == [first, other]
    assert pool.workers[first].failures == 1 and pool.workers[other].failures == 0


def test_a_coalesced_request_that_loses_its_worker_resumes_after_what_arrived():
    """A non-streaming client's request asks for coalescing; the worker fails after the first token, and the
    request continues on another worker from prompt + that token, still coalesced."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first = orchestrator._place(pool, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    other = next(u for u in pool.workers if u != first)
    # The first worker had 1 prompt token cached; the one resumed on has prompt + the first token cached: 4, counted
    # over prompt + output, as a worker counts it.
    http.script[first] = [{"token_ids": [7], "text": "x", "num_cached_tokens": 1}, error_body(503, "engine died")]
    http.script[other] = [{"token_ids": [8, 9], "text": "yz", "finish_reason": "length", "num_cached_tokens": 4}]

    async def run():
        params = SamplingParams(temperature=0, max_tokens=3)
        return [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace(), coalesce=True)]

    deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.new_token_ids] == [7, 8, 9]
    # usage's cached tokens are the first computation's, not the resumed one's
    assert [d.num_cached_tokens for d in deltas] == [1, 1]
    assert http.calls == [first, other]
    assert all(body["coalesce_after_first"] for body in http.bodies)
    resumed = http.bodies[1]
    assert resumed["prompt_token_ids"] == [1, 2, 3] and resumed["first_token_id"] == 7
    assert resumed["sampling"]["max_tokens"] == 3  # the first token counts as output already sent
    assert "output_tokens_in_prompt" not in resumed  # no output in its prompt to replay


def test_events_that_arrive_together_are_relayed_as_one_delta_and_resumed_after():
    """A router that fell behind takes the worker's queued events as a batch: their tokens make one delta (one
    chunk to the client). A failure inside the batch still hands over the tokens before it, and the request
    resumes after them."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first = orchestrator._place(pool, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    other = next(u for u in pool.workers if u != first)
    http.script[first] = [[{"token_ids": [7], "text": "x", "logprobs": [{"token_id": 7, "logprob": -0.5}]},
                           {"token_ids": [8], "text": "y", "logprobs": [{"token_id": 8, "logprob": -0.25}]},
                           error_body(503, "engine died")]]
    http.script[other] = [[{"token_ids": [9], "text": "z"}, {"token_ids": [10], "text": "!", "finish_reason": "length"}]]

    async def run():
        params = SamplingParams(temperature=0, max_tokens=4)
        return [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace())]

    deltas = asyncio.run(run())
    assert [(d.new_token_ids, d.new_text) for d in deltas] == [([7, 8], "xy"), ([9, 10], "z!")]
    assert [(e.token_id, e.logprob) for e in deltas[0].new_logprobs] == [(7, -0.5), (8, -0.25)]
    assert deltas[-1].finished and deltas[-1].finish_reason == "length" and not deltas[0].finished
    resumed = http.bodies[1]
    assert resumed["prompt_token_ids"] == [1, 2, 3, 7] and resumed["first_token_id"] == 8
    assert resumed["sampling"]["max_tokens"] == 3  # 4, less the 2 tokens sent, plus the first token given back
    assert resumed["output_tokens_in_prompt"] == 1  # 7 is output: the new worker replays it (stop strings)


def first_and_other(orchestrator: Orchestrator, pool: WorkerPool) -> tuple[str, str]:
    first = orchestrator._place(pool, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    return first, next(u for u in pool.workers if u != first)


def test_a_client_that_leaves_after_a_resume_stops_each_attempt_under_its_own_id():
    """The failed attempt is aborted when it is given up on (its worker may only have stopped answering); the
    resumed one, which runs as r1-m1, under that id when the client leaves."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first, other = first_and_other(orchestrator, pool)
    http.script[first] = [{"token_ids": [7], "text": "x"}, aiohttp.ClientConnectionError("gone")]
    http.script[other] = [{"token_ids": [8], "text": "y"}, {"token_ids": [9], "text": "z"}]

    async def leave_after_two():
        deltas = orchestrator.run("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), Trace())
        got = [await deltas.__anext__(), await deltas.__anext__()]
        await deltas.aclose()
        await asyncio.sleep(0.01)  # the aborts are sent on their way
        return got

    assert [d.new_token_ids for d in asyncio.run(leave_after_two())] == [[7], [8]]
    assert http.aborts == [(first, "r1"), (other, "r1-m1")]
    assert all(w.in_flight == 0 for w in pool.workers.values())


def test_a_connection_lost_after_the_finish_is_no_failure():
    """Only the end of the stream was lost: nothing is resumed, and the worker that finished is not blamed."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first, _ = first_and_other(orchestrator, pool)
    http.script[first] = [{"token_ids": [7], "text": "x", "finish_reason": "stop"}, aiohttp.ClientConnectionError()]
    deltas = asyncio.run(collect(orchestrator))
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [([7], "stop")]
    assert http.calls == [first] and pool.workers[first].failures == 0 and not http.aborts


def test_in_flight_counts_stay_right_when_discovery_replaces_a_worker_meanwhile():
    """set_members() dropping and re-adding a URL (a readiness blip) makes a new Worker: the request's end is
    counted on the one it started on, so no count goes negative."""
    orchestrator, pool, http = orchestrator_over({"http://a": []})
    http.script["http://a"] = [{"token_ids": [7], "text": "x"}, {"token_ids": [8], "text": "y", "finish_reason": "length"}]

    async def with_blip():
        deltas = orchestrator.run("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2), Trace())
        await deltas.__anext__()
        pool.set_members([])
        pool.set_members(["http://a"])
        return [d async for d in deltas]

    asyncio.run(with_blip())
    assert pool.workers["http://a"].in_flight == 0


def test_once_a_decode_worker_has_the_handle_the_prefill_worker_is_not_aborted():
    """Its decode worker releases the lease; an abort at the prefill worker would free blocks being pulled."""
    orchestrator, pool, http = orchestrator_over({"http://d": [{"token_ids": [7], "text": "x"},
                                                                {"token_ids": [8], "text": "y"}]})
    orchestrator.prefill.workers["http://p"] = Worker("http://p", healthy=True)
    orchestrator.prefill.ring.add("http://p")
    orchestrator.config.disagg_min_tokens = 1

    async def leave_after_the_first_decoded_token():
        deltas = orchestrator.run("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), Trace())
        got = [await deltas.__anext__(), await deltas.__anext__()]  # the prefill's token, then the decode's
        await deltas.aclose()
        await asyncio.sleep(0.01)
        return got

    assert [d.new_token_ids for d in asyncio.run(leave_after_the_first_decoded_token())] == [[6], [7]]
    assert http.bodies[0]["kv_handle"] == {"lease_id": "lease-1"}
    assert http.aborts == [("http://d", "r1")]


def test_a_request_given_up_before_its_decode_call_went_out_frees_the_prefill_workers_blocks():
    """The client leaves after the prefill's first token, while the decode call is still on its way (the channel
    to the decode worker being opened): no decode worker has the handle, so the prefill worker is told to abort,
    which frees the prompt's blocks now rather than when the lease runs out."""
    orchestrator, pool, http = orchestrator_over({"http://d": [HANG]})
    orchestrator.prefill.workers["http://p"] = Worker("http://p", healthy=True)
    orchestrator.prefill.ring.add("http://p")
    orchestrator.config.disagg_min_tokens = 1

    async def leave_while_the_decode_call_waits():
        deltas = orchestrator.run("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8), Trace())
        first = await deltas.__anext__()  # the prefill's token
        waiting = asyncio.get_running_loop().create_task(deltas.__anext__())
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left
        await asyncio.gather(waiting, return_exceptions=True)
        await deltas.aclose()
        await asyncio.sleep(0.01)
        return first

    assert asyncio.run(leave_while_the_decode_call_waits()).new_token_ids == [6]
    assert http.calls == ["http://d"]
    assert sorted(http.aborts) == [("http://d", "r1"), ("http://p", "r1")]


def test_a_decode_worker_lost_with_the_handle_frees_the_prefill_workers_blocks_at_once():
    """The failed decode worker may never release the lease (it died, or hangs): the router gives the blocks back
    when it gives up on it, not when the lease runs out, and resumes elsewhere from prompt + tokens. (A hung worker
    that finishes its read later finds the lease gone and does not use what it read: test_engine_pd.)"""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first, other = "http://a", "http://b"
    pool.workers[first].free_blocks = 1000  # the decode worker the handle goes to: the one with room
    http.script[first] = [aiohttp.ClientConnectionError("gone")]
    http.script[other] = [{"token_ids": [8], "text": "y", "finish_reason": "length"}]
    orchestrator.prefill.workers["http://p"] = Worker("http://p", healthy=True)
    orchestrator.prefill.ring.add("http://p")
    orchestrator.config.disagg_min_tokens = 1

    async def run_it():
        deltas = await collect(orchestrator, max_tokens=2)
        await asyncio.sleep(0.01)  # the aborts are sent on their way
        return deltas

    assert [d.new_token_ids for d in asyncio.run(run_it())] == [[6], [8]]
    assert http.bodies[0]["kv_handle"] == {"lease_id": "lease-1"} and http.bodies[1]["kv_handle"] is None
    assert sorted(http.aborts) == sorted([(first, "r1"), ("http://p", "r1")])


def test_a_stream_lost_after_its_last_token_still_ends_with_its_finish_reason():
    """All max_tokens arrived but not the event that says the stream is over: nothing is left to resume, and the
    client still gets a finish_reason ("length", as the worker would have said)."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first, _ = first_and_other(orchestrator, pool)
    http.script[first] = [{"token_ids": [7], "text": "x", "num_cached_tokens": 2},
                          {"token_ids": [8], "text": "y", "num_cached_tokens": 2}, aiohttp.ClientConnectionError()]

    deltas = asyncio.run(collect(orchestrator, max_tokens=2))
    assert [(d.new_token_ids, d.finished, d.finish_reason) for d in deltas] == [
        ([7], False, None), ([8], False, None), ([], True, "length")]
    assert deltas[-1].num_cached_tokens == 2 and http.calls == [first]


class FailingPrefill(ScriptedWorkers):
    async def get(self, url: str, timeout=None):
        """A probe's answer: alive and ready (a worker that fails a request but still answers is not down)."""
        import httpx

        load = {"free_blocks": 100, "total_blocks": 100, "running": 0, "waiting": 0, "role": "both"}
        return httpx.Response(200, json=load if url.endswith("/internal/load") else {"status": "ready"})

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        if path == "/internal/prefill":
            raise aiohttp.ClientConnectionError("prefill worker gone")
        return await super().post_json(worker, path, payload, timeout_s)


def test_a_request_that_falls_back_to_colocated_is_one_routing_decision():
    orchestrator, _, _, metrics = split_orchestrator(FailingPrefill({"http://d": [GOOD]}), "test-fallback")
    deltas = asyncio.run(collect(orchestrator))
    assert [d.new_token_ids for d in deltas] == [[7]]
    decisions = {path: metric_value(metrics.registry, "tandem_router_routing_decisions_total", path=path)
                 for path in ("fallback", "colocated", "disagg")}
    assert decisions == {"fallback": 1, "colocated": 0, "disagg": 0}


class BadPrefillAnswer(ScriptedWorkers):
    def __init__(self, script, answer: dict):
        super().__init__(script)
        self.answer = answer

    async def get(self, url: str, timeout=None):
        """A probe's answer: alive and ready (a worker that fails a request but still answers is not down)."""
        import httpx

        load = {"free_blocks": 100, "total_blocks": 100, "running": 0, "waiting": 0, "role": "both"}
        return httpx.Response(200, json=load if url.endswith("/internal/load") else {"status": "ready"})

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        if path == "/internal/prefill":
            return {"request_id": payload["request_id"], **self.answer}
        return await super().post_json(worker, path, payload, timeout_s)


PREFILL_ANSWER = {"first_token_id": 6, "first_token_text": "w", "finish_reason": None, "num_cached_tokens": 0,
                  "kv_handle": {"lease_id": "lease-1"}}


@pytest.mark.parametrize("event, answer", [
    ({"text": "x", "finish_reason": "length"}, {"first_token": 6}),  # fields missing
    ({"token_ids": 7, "text": "x", "finish_reason": "length"}, {**PREFILL_ANSWER, "kv_handle": "lease-1"}),
    ({"token_ids": [7], "text": 7, "finish_reason": "length"}, {**PREFILL_ANSWER, "first_token_id": "6"}),
    ({**GOOD, "num_cached_tokens": "a"}, {**PREFILL_ANSWER, "num_cached_tokens": None}),
    ({"error": "boom"}, {k: v for k, v in PREFILL_ANSWER.items() if k != "kv_handle"}),
    (7, {**PREFILL_ANSWER, "finish_reason": 1}),
], ids=["missing", "token_ids", "text", "cached", "error", "not-an-object"])
def test_an_answer_without_its_fields_is_the_workers_failure(event, answer):
    """A worker that answers what its protocol never says (an event or a prefill answer without its fields, or
    with fields of the wrong type) fails like one whose connection broke: the request goes on elsewhere, and the
    worker is counted as failing (ejected after enough), rather than the client getting a 500 or a cut stream."""
    orchestrator, pool, http = orchestrator_over({"http://a": [], "http://b": []})
    first, other = first_and_other(orchestrator, pool)
    http.script[first] = [event]
    http.script[other] = [GOOD]
    assert [d.new_token_ids for d in asyncio.run(collect(orchestrator))] == [[7]]
    assert http.calls == [first, other]
    assert pool.workers[first].failures == 1 and pool.workers[other].failures == 0

    orchestrator, prefill, _, _ = split_orchestrator(BadPrefillAnswer({"http://d": [GOOD]}, answer),
                                                     "test-bad-prefill")
    assert [d.new_token_ids for d in asyncio.run(collect(orchestrator))] == [[7]]  # served colocated
    assert prefill.workers["http://p"].failures == 1


class OtherLayout(ScriptedWorkers):
    """Decode workers whose KV layout is not the prefill worker's: they refuse a handle, and serve a prompt they
    compute themselves (after `failing` such calls have failed)."""

    def __init__(self, script, failing: int = 0):
        super().__init__(script)
        self.failing = failing

    async def event_batches(self, worker: str, path: str, body: dict):
        self.calls.append(worker)
        self.bodies.append(body)
        if body["kv_handle"] is not None:
            raise WorkerStatusError(400, "incompatible KV layout: dtype: handle 'float32', this worker 'bfloat16'",
                                    "kv_layout_mismatch")
        if self.failing:
            self.failing -= 1
            raise aiohttp.ClientConnectionError("gone")
        yield [{"token_ids": [8], "text": "y", "finish_reason": "length", "num_cached_tokens": 0}]


def test_a_handle_the_decode_pool_cannot_read_is_computed_again_there(caplog):
    """A pool set up with another dtype or block size than its peer is the operator's mistake, not the client's:
    the decode worker computes the prompt itself (from prompt + the prefill's first token), as after a lost
    prefill, counted as a fallback and said in the log, once per pair of workers."""
    http = OtherLayout({})
    orchestrator, _, decode, metrics = split_orchestrator(http, "test-layout")
    for _ in range(2):
        assert [d.new_token_ids for d in asyncio.run(collect(orchestrator, max_tokens=2))] == [[6], [8]]
    assert http.calls == ["http://d"] * 4
    recomputed = http.bodies[1]
    assert recomputed["kv_handle"] is None and recomputed["prompt_token_ids"] == [1, 2, 3]
    assert recomputed["first_token_id"] == 6 and recomputed["sampling"]["max_tokens"] == 2
    assert decode.workers["http://d"].failures == 0 and decode.workers["http://d"].healthy
    assert metric_value(metrics.registry, "tandem_router_routing_decisions_total", path="fallback") == 2
    assert caplog.text.count("cannot read the KV of prefill worker http://p") == 1


def test_a_handle_no_decode_worker_can_read_costs_the_request_none_of_its_attempts():
    """After the refused handle, the request still survives two failed decode workers, as any request does."""
    http = OtherLayout({}, failing=2)
    orchestrator, _, _, _ = split_orchestrator(http, "test-layout-attempts", ("http://d1", "http://d2", "http://d3"))
    assert [d.new_token_ids for d in asyncio.run(collect(orchestrator, max_tokens=2))] == [[6], [8]]
    assert len(http.calls) == 4 and len(set(http.calls[1:])) == 3  # the two that failed, then the third worker


def test_a_split_requests_cached_tokens_are_the_prefill_workers():
    """The prefill worker computed the prompt (2 of its 3 tokens from its cache); the decode worker, which pulled the
    KV, counts its own cache (none): usage reports the prefill's, capped at the prompt."""
    for reported, expected in ((2, 2), (5, 3)):
        http = BadPrefillAnswer({"http://d": [{**GOOD, "num_cached_tokens": 0}]},
                                {**PREFILL_ANSWER, "num_cached_tokens": reported})
        orchestrator, _, _, _ = split_orchestrator(http, f"test-split-cached-{reported}")
        deltas = asyncio.run(collect(orchestrator, max_tokens=2))
        assert [d.new_token_ids for d in deltas] == [[6], [7]]
        assert [d.num_cached_tokens for d in deltas] == [expected, expected]


def test_a_request_whose_decode_pool_empties_waits_for_a_worker_to_come_back(caplog):
    """The only decode worker dies mid-stream and is ejected (a pool of one restarting; a whole pool frozen): the
    request waits for a worker to enter rotation, then resumes there after the tokens already sent, the restarted
    worker at the same address included (found by a chaos-testing helper: such requests failed with 503 at once)."""
    orchestrator, pool, http = orchestrator_over({"http://a": [{"token_ids": [7], "text": "x"},
                                                               aiohttp.ClientConnectionError("reset")]})
    pool.eject_after = 1

    async def run():
        async def restart():
            await asyncio.sleep(0.2)
            assert not pool.workers["http://a"].healthy  # ejected: the request is waiting
            http.script["http://a"] = [{"token_ids": [8, 9], "text": "yz", "finish_reason": "length"}]
            pool._set_healthy(pool.workers["http://a"], True)

        restarting = asyncio.create_task(restart())
        params = SamplingParams(temperature=0, max_tokens=3)
        deltas = [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace())]
        await restarting
        return deltas

    with caplog.at_level("INFO", logger="tandem.router.orchestrator"):
        deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.new_token_ids] == [7, 8, 9]
    assert http.calls == ["http://a", "http://a"] and http.bodies[1]["first_token_id"] == 7
    assert "r1 waits up to 10 s for a decode worker to be back" in caplog.text  # not "goes on another" (none)
    assert metric_value(orchestrator.metrics.registry, "tandem_router_routing_decisions_total", path="migrated") == 1


def test_a_request_whose_decode_pool_stays_empty_fails_after_the_wait():
    orchestrator, pool, http = orchestrator_over({"http://a": [{"token_ids": [7], "text": "x"},
                                                               aiohttp.ClientConnectionError("reset")]})
    pool.eject_after = 1
    orchestrator.config = orchestrator.config.model_copy(update={"worker_return_wait_s": 0.6})

    refuse_probes(http)  # the wait's probes find it still down

    async def run():
        started = asyncio.get_running_loop().time()
        with pytest.raises(APIError) as info:
            await collect(orchestrator, max_tokens=3)
        return info.value, asyncio.get_running_loop().time() - started

    error, took = asyncio.run(run())
    assert error.status == 503 and error.code == "no_workers" and 0.6 <= took < 5
    # It had nowhere to go on to: not a migration (a chaos-testing helper saw these counted as migrated).
    assert metric_value(orchestrator.metrics.registry, "tandem_router_routing_decisions_total", path="migrated") == 0


def refuse_probes(http: ScriptedWorkers) -> list[str]:
    """From now on the workers refuse probes (down); returns the list of URLs probed meanwhile."""
    import httpx

    probed: list[str] = []

    async def down(url, timeout=None):
        probed.append(url)
        raise httpx.ConnectError("connection refused")

    http.get = down
    return probed


def tokens_through_a_restart(orchestrator, pool, http, while_down=lambda probed: None) -> list[int]:
    """Runs a request whose only decode worker fails mid-stream and refuses probes; once out of rotation it stays
    down for 4 x RETURN_PROBE_S (`while_down(probed URLs)` is then called, its return value kept), then answers
    again: the request's tokens, and what while_down returned."""
    alive = http.get
    probed = refuse_probes(http)
    seen = []

    async def run():
        async def restart():
            while pool.workers["http://a"].healthy:  # until the failure or a probe took it out
                await asyncio.sleep(0.01)
            await asyncio.sleep(4 * RETURN_PROBE_S)
            seen.append(while_down(list(probed)))  # asserted by the caller: a failure here would only hang the test
            http.script["http://a"] = [{"token_ids": [8, 9], "text": "yz", "finish_reason": "length"}]
            http.get = alive

        restarting = asyncio.create_task(restart())
        deltas = [d async for d in orchestrator.run("r1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3),
                                                    Trace())]
        await restarting
        return [t for d in deltas for t in d.new_token_ids]

    return asyncio.run(run()), seen[0]


def test_a_crashed_lone_decode_worker_is_waited_for_though_one_failure_does_not_eject_it():
    """With the default --eject-after-failures (3), the crash alone leaves the worker in rotation: the probe the
    router sends once every worker in rotation has failed the request is what finds it down (found by a review
    helper: such a request failed with 503 at once)."""
    orchestrator, pool, http = orchestrator_over({"http://a": [{"token_ids": [7], "text": "x"},
                                                               aiohttp.ClientConnectionError("reset")]})
    assert pool.eject_after == 3
    assert tokens_through_a_restart(orchestrator, pool, http)[0] == [7, 8, 9]
    assert http.calls == ["http://a", "http://a"]


def test_a_waiting_request_probes_the_absent_workers_itself():
    """No probe loop runs here: a worker restarted while a request waits is taken back by the wait's own probes,
    made every RETURN_PROBE_S, not only at the loop's next round, up to an interval later, when the wait may have
    run out (found by a chaos-testing helper). Those probes do not count towards the silence that fails a worker's
    requests: that stays the loop's to judge."""
    orchestrator, pool, http = orchestrator_over({"http://a": [{"token_ids": [7], "text": "x"},
                                                               aiohttp.ClientConnectionError("reset")]})
    pool.eject_after = 1

    tokens, (probed, silent_probes) = tokens_through_a_restart(
        orchestrator, pool, http, lambda probed: (probed, pool.workers["http://a"].silent_probes))
    assert tokens == [7, 8, 9] and http.calls == ["http://a", "http://a"]
    assert len(probed) >= 2 and silent_probes == 0  # probed while down, several times, none of it counted as silence


class PrefillScript(ScriptedWorkers):
    """Prefill workers that fail as scripted ({url: exception}) and answer otherwise."""

    def __init__(self, script: dict[str, list[dict]], prefill_failures: dict[str, BaseException]):
        super().__init__(script)
        self.prefill_failures = prefill_failures
        self.prefill_calls: list[str] = []

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        if path == "/internal/prefill":
            self.prefill_calls.append(worker)
            if worker in self.prefill_failures:
                raise self.prefill_failures[worker]
        return await super().post_json(worker, path, payload, timeout_s)


@pytest.mark.parametrize("failure", [WorkerStatusError(503, "engine died"), aiohttp.ClientConnectionError("reset")],
                         ids=["status-503", "connection-lost"])
def test_a_prefill_that_fails_on_one_prefill_worker_is_retried_on_another(failure):
    """The prompt is computed on a second prefill worker; the first is counted as failed (and told to abort, when
    it only stopped answering), and the request decodes from the second's handle."""
    http = PrefillScript({"http://d": [GOOD]}, {})
    orchestrator, prefill, _, metrics = split_orchestrator(http, "test", ("http://d",))
    prefill.workers["http://p2"] = Worker("http://p2", healthy=True)
    prefill.ring.add("http://p2")
    first = orchestrator._place(prefill, orchestrator.plan([1, 2, 3])[1], [], 3, set(), Trace())
    other = next(u for u in prefill.workers if u != first)
    http.prefill_failures[first] = failure
    trace = Trace()
    deltas = asyncio.run(_collect_traced(orchestrator, trace))
    assert [d.new_token_ids for d in deltas] == [[6], [7]]  # the second prefill worker's first token, then decode
    assert http.prefill_calls == [first, other] and trace.prefill_worker == other and trace.path == "disagg"
    assert prefill.workers[first].failures == 1 and prefill.workers[other].failures == 0
    assert all(w.in_flight == 0 and w.prefill_tokens_in_flight == 0 for w in prefill.workers.values())
    assert http.bodies[0]["kv_handle"] == {"lease_id": "lease-1"}


async def _collect_traced(orchestrator: Orchestrator, trace: Trace):
    params = SamplingParams(temperature=0, max_tokens=2)
    return [d async for d in orchestrator.run("r1", [1, 2, 3], params, trace)]
