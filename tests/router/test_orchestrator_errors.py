"""What the orchestrator makes of an error event inside a decode worker's stream: a request the engine
refused (invalid_request_error) is the client's 400 and leaves the worker healthy; anything else is the
worker's failure and the request moves to another worker."""

from __future__ import annotations

import asyncio

import pytest

from tandem.config import RouterConfig
from tandem.errors import APIError, error_body
from tandem.metrics import RouterMetrics
from tandem.protocol import SamplingParams
from tandem.router.orchestrator import Orchestrator, Trace
from tandem.router.pool import Worker, WorkerPool

GOOD = {"token_ids": [7], "text": "x", "finish_reason": "length"}


class ScriptedWorkers:
    """Stands in for WorkerClient: each decode worker answers its scripted chunks, each alone, or a list of chunks
    as one batch (events that arrived together)."""

    def __init__(self, script: dict[str, list[dict]]):
        self.script = script
        self.calls: list[str] = []
        self.bodies: list[dict] = []

    async def event_batches(self, worker: str, path: str, body: dict):
        assert path == "/internal/decode"
        self.calls.append(worker)
        self.bodies.append(body)
        for chunk in self.script[worker]:
            yield chunk if isinstance(chunk, list) else [chunk]


def orchestrator_over(script: dict[str, list[dict]]) -> tuple[Orchestrator, WorkerPool, ScriptedWorkers]:
    metrics = RouterMetrics("test")
    http = ScriptedWorkers(script)
    decode = WorkerPool("decode", http, metrics)
    for url in script:
        decode.workers[url] = Worker(url, healthy=True)
        decode.ring.add(url)
    return Orchestrator(RouterConfig(), WorkerPool("prefill", http, metrics), decode, http, metrics, 0), decode, http


async def collect(orchestrator: Orchestrator):
    params = SamplingParams(temperature=0, max_tokens=1)
    return [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace())]


def test_a_refused_request_is_the_clients_error_and_no_worker_failure():
    refused = error_body(400, "seed out of range")
    orchestrator, pool, http = orchestrator_over({"http://a": [refused], "http://b": [refused]})
    with pytest.raises(APIError) as caught:
        asyncio.run(collect(orchestrator))
    assert caught.value.status == 400 and "seed out of range" in str(caught.value.message)
    assert len(http.calls) == 1  # not retried elsewhere
    assert all(w.failures == 0 and w.healthy for w in pool.workers.values())


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
    http.script[first] = [{"token_ids": [7], "text": "x"}, error_body(503, "engine died")]
    http.script[other] = [{"token_ids": [8, 9], "text": "yz", "finish_reason": "length"}]

    async def run():
        params = SamplingParams(temperature=0, max_tokens=3)
        return [d async for d in orchestrator.run("r1", [1, 2, 3], params, Trace(), coalesce=True)]

    deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.new_token_ids] == [7, 8, 9]
    assert http.calls == [first, other]
    assert all(body["coalesce_after_first"] for body in http.bodies)
    resumed = http.bodies[1]
    assert resumed["prompt_token_ids"] == [1, 2, 3] and resumed["first_token_id"] == 7
    assert resumed["sampling"]["max_tokens"] == 3  # the first token counts as output already sent


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
