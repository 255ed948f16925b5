"""SLO admission keeps its word on a cold `tandem serve` (one prefill and one decode SmolLM2 worker, P/D from 16
tokens, the decode worker holding 4 sequences): prompts too long for the interactive class's 1 s TTFT target are
refused at once, bursts are admitted only as far as they fit, and streams beyond what the decode pool holds wait
their turn rather than stall.

Margins for a shared 2-core CI host (the router, both workers and this test share its cores): an admitted request's
TTFT within its target + 0.5 s, a stream's worst gap between tokens within its ITL target + 0.5 s.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import httpx
import pytest

from tandem.runtimes.launcher import ServiceProcess

TTFT_MARGIN_S = ITL_MARGIN_S = 0.5


@pytest.fixture(scope="module")
def stack():
    with ServiceProcess(["serve", "--model", "smollm2", "--kv-transfer", "tcp", "--disagg-min-tokens", "16",
                         "--max-num-seqs", "4"], name="admission-serve") as proc:
        proc.wait_ready(300)
        yield proc


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(length)]


async def stream(session: aiohttp.ClientSession, url: str, prompt: list[int], slo: str, max_tokens: int) -> dict:
    """The answer's status, and for a 200 its TTFT and worst gap between streamed tokens (seconds)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-tandem-slo-class": slo}) as r:
        if r.status != 200:
            return {"status": r.status, "body": await r.json(), "retry_after": r.headers.get("Retry-After")}
        first = last = None
        worst = 0.0
        async for line in r.content:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    worst = max(worst, now - last)
                last = now
        return {"status": 200, "ttft": first, "worst_gap": worst}


def run(url: str, requests: list[tuple[list[int], str, int]]) -> list[dict]:
    """Sends (prompt, SLO class, max_tokens) requests all at once; their outcomes in order."""
    async def main():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(stream(session, url, *r) for r in requests))
    return asyncio.run(main())


def test_on_a_cold_stack_prompts_too_long_for_the_target_are_refused_and_the_admitted_meet_it(stack):
    rng = random.Random(1)
    outcomes = []
    for length in (64, 3000, 200, 2000, 16):  # one at a time, the stack idle between them
        outcomes.append((length, run(stack.url, [(random_prompt(rng, length), "interactive", 4)])[0]))
    refused = {length: o for length, o in outcomes if o["status"] == 429}
    assert set(refused) >= {3000, 2000}, outcomes  # seconds of prefill each on a CPU worker
    for o in refused.values():
        error = o["body"]["error"]
        assert error["code"] == "slo_unmeetable" and "the prompt alone" in error["message"], o
        assert o["retry_after"] is None  # waiting cannot help it
    admitted = [o for _, o in outcomes if o["status"] == 200]
    assert admitted, outcomes
    assert all(o["ttft"] <= 1.0 + TTFT_MARGIN_S for o in admitted), outcomes
    # The same long prompt in the batch class (30 s) is served.
    long_batch = run(stack.url, [(random_prompt(rng, 2000), "batch", 4)])[0]
    assert long_batch["status"] == 200 and long_batch["ttft"] <= 30, long_batch


def test_a_burst_is_admitted_as_far_as_it_fits(stack):
    rng = random.Random(2)
    for burst in range(2):
        prefix = random_prompt(rng, 200)  # a new shared prefix each burst
        outcomes = run(stack.url, [(prefix + random_prompt(rng, 16), "interactive", 4) for _ in range(12)])
        statuses = sorted(o["status"] for o in outcomes)
        assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, outcomes
        assert all(o["ttft"] <= 1.0 + TTFT_MARGIN_S for o in outcomes if o["status"] == 200), (burst, outcomes)


def test_streams_past_what_the_decode_pool_holds_wait_their_turn_instead_of_stalling(stack):
    """12 streams of 120 tokens at once, 4 decoded at a time: without decode admission the 8 others would get
    their first token from the prefill worker and then nothing for a whole stream's time (about 3 s here)."""
    before = metrics(stack.url)
    rng = random.Random(3)
    outcomes = run(stack.url, [(random_prompt(rng, 40), "batch", 120) for _ in range(12)])
    served = [o for o in outcomes if o["status"] == 200]
    assert len(served) >= 8, outcomes
    assert all(o["status"] == 429 and o["body"]["error"]["code"] == "decode_capacity" for o in outcomes
               if o["status"] != 200), outcomes
    assert all(o["worst_gap"] <= 1.0 + ITL_MARGIN_S for o in served), outcomes
    assert all(o["ttft"] <= 30.0 + TTFT_MARGIN_S for o in served), outcomes
    assert sorted(o["ttft"] for o in served)[-1] > 2.0  # the last waited for a stream to end: held, not stalled
    after = metrics(stack.url)
    answered = after["requests"] - before["requests"]
    assert answered == len(served)
    # Each answered stream counts as goodput or as a violation of a target (or of both).
    assert after["goodput"] - before["goodput"] + after["violations"] - before["violations"] >= answered


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    totals = {"requests": 0.0, "goodput": 0.0, "violations": 0.0}
    names = {"tandem_router_requests_total": "requests", "tandem_router_goodput_requests_total": "goodput",
             "tandem_router_slo_violations_total": "violations"}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in names and 'slo_class="batch"' in line:
            totals[names[name]] += float(line.rsplit(" ", 1)[1])
    return totals
