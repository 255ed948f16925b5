"""Decode admission: how many streams the decode pool holds at an inter-token target, the dispatcher holding the
rest, and the wait admission predicts for them."""

import asyncio

import pytest

from tandem.router.admission import (
    BATCH,
    INTERACTIVE,
    AdmissionController,
    AdmissionRequest,
    Admit,
    Reject,
    RejectReason,
)
from tandem.router.admission.decode_capacity import DecodeCapacity
from tandem.router.dispatcher import Dispatcher
from tandem.router.pool import Worker
from tandem.step_cost import StepCost

# 10 ms a step, 2.5 ms a sequence, nothing per context token: 36 sequences in a 100 ms step.
COST = StepCost(base_s=0.01, token_s=0.002, sequence_s=0.0005, pair_s=0.0, decode_base_s=0.01,
                decode_sequence_s=0.0025, decode_pair_s=0.0)


def worker(url="w", max_num_seqs=64, total_blocks=10_000, cost=COST, running=0, mine=0) -> Worker:
    return Worker(url, healthy=True, max_num_seqs=max_num_seqs, total_blocks=total_blocks, free_blocks=total_blocks,
                  step_cost=cost, running=running, in_flight=mine, in_flight_at_report=mine)


def test_streams_are_the_fewest_that_the_batch_limit_the_kv_cache_and_the_target_allow():
    # A stream of 40 + 100 tokens needs 9 blocks of 16.
    assert DecodeCapacity(lambda: [worker()], 16).streams(0.1, 40, 100) == (36, True)  # the step time binds
    assert DecodeCapacity(lambda: [worker(max_num_seqs=8)], 16).streams(0.1, 40, 100) == (8, True)
    assert DecodeCapacity(lambda: [worker(total_blocks=100)], 16).streams(0.1, 40, 100) == (11, True)  # 100 // 9
    assert DecodeCapacity(lambda: [worker(total_blocks=8)], 16).streams(0.1, 40, 100) == (0, True)  # none fits
    assert DecodeCapacity(lambda: [worker()], 16).streams(1.0, 40, 100) == (64, True)  # a loose target
    two = DecodeCapacity(lambda: [worker("a"), worker("b", max_num_seqs=8)], 16)
    assert two.streams(0.1, 40, 100) == (44, True)
    # The blocks its running streams hold count: 10 running, 18 blocks free, streams of 9 blocks: 10 + 2.
    busy = worker(total_blocks=1000, running=10, mine=10)
    busy.free_blocks = 18
    assert DecodeCapacity(lambda: [busy], 16).streams(1.0, 40, 100) == (12, True)


def test_streams_other_routers_hold_are_not_this_routers():
    # 10 sequences reported, 4 of them this router's when the report came: 6 are another router's.
    capacity = DecodeCapacity(lambda: [worker(running=10, mine=4)], 16)
    assert capacity.streams(0.1, 40, 100) == (30, True)


def test_a_worker_whose_steps_run_long_at_worst_holds_fewer_streams_and_a_handoff_needs_two_steps():
    slow = worker(running=1, mine=1)
    slow.step_tail = 2.0  # its gaps ran twice the predicted step at worst: 50 ms of predicted step is the budget
    assert DecodeCapacity(lambda: [slow], 16).streams(0.1, 40, 100) == (16, True)  # (0.05 - 0.01) / 0.0025
    slow.running = slow.in_flight = 0  # idle: its steps are judged without the tail its load gave them
    assert DecodeCapacity(lambda: [slow], 16).streams(0.1, 40, 100) == (36, True)
    # A stream from a prefill worker: its KV pull (10 ms) and two steps before its second token, within 100 ms.
    assert DecodeCapacity(lambda: [worker()], 16).streams(0.1, 40, 100, handoff_itl_s=0.1) == (16, True)
    w = worker()
    w.kv_pull_s = 0.01
    assert DecodeCapacity(lambda: [w], 16).streams(0.1, 40, 100, handoff_itl_s=0.1) == (14, True)


def test_a_target_no_worker_meets_even_alone_is_said_and_no_workers_is_none():
    too_slow = StepCost(0.2, 0.001, 0.0, 0.0, 0.2, 0.001, 0.0)
    assert DecodeCapacity(lambda: [worker(cost=too_slow)], 16).streams(0.1, 40, 100) == (0, False)
    assert DecodeCapacity(lambda: [], 16).streams(0.1, 40, 100) is None
    # A worker that reports no model is held to its batch limit and KV cache alone.
    assert DecodeCapacity(lambda: [worker(cost=None)], 16).streams(0.001, 40, 100) == (64, True)


def test_a_streams_hold_is_its_output_at_the_step_time_of_the_batch():
    capacity = DecodeCapacity(lambda: [worker()], 16)
    assert capacity.hold_s(40, 100, 36) == pytest.approx(100 * COST.decode_step_s(36, 36 * 90))
    assert DecodeCapacity(lambda: [worker(cost=None)], 16).hold_s(40, 100, 36) is None


def request(rid, slo="batch", max_tokens=100, prompt=40) -> AdmissionRequest:
    return AdmissionRequest(rid, prompt, max_tokens, slo, ignore_eos=True, uncached_prompt_tokens=prompt,
                            prefill_s=0.1)


def stack(clock, **kwargs):
    control = AdmissionController(clock=clock)
    dispatcher = Dispatcher(control, limit=512, metrics=None, clock=clock,
                            decode=DecodeCapacity(lambda: [worker(**kwargs)], 16))
    return control, dispatcher


def test_streams_past_the_capacity_wait_for_a_slot_and_are_dispatched_as_slots_free(clock):
    async def scenario():
        control, dispatcher = stack(clock, max_num_seqs=2)
        for rid in ("a", "b", "c"):
            assert isinstance(control.decide(request(rid)), Admit)
        await dispatcher.acquire("a")
        await dispatcher.acquire("b")
        third = asyncio.get_running_loop().create_task(dispatcher.acquire("c"))
        await asyncio.sleep(0.05)
        assert not third.done() and dispatcher.active == 2  # the pool holds two streams: the third waits
        control.release("a")
        dispatcher.release("a", 5.0, "batch")
        await asyncio.wait_for(third, 1.0)
        assert dispatcher.active == 2

    asyncio.run(scenario())


def test_the_predicted_wait_follows_the_slots_as_they_free(clock):
    control, dispatcher = stack(clock, max_num_seqs=2)
    hold = 0.1 + 100 * COST.decode_step_s(2, 2 * 90)  # prefill, then 100 tokens at a batch of two
    for rid in ("a", "b"):
        control.decide(request(rid))
        assert dispatcher._take(rid)
    clock.advance(1.0)
    assert dispatcher.wait_s(request("x"), BATCH, 0)[0] == pytest.approx(hold - 1.0)
    assert dispatcher.wait_s(request("x"), BATCH, 1)[0] == pytest.approx(hold - 1.0)
    assert dispatcher.wait_s(request("x"), BATCH, 2) == (pytest.approx(2 * hold - 1.0), RejectReason.DECODE_CAPACITY)


def test_a_stream_that_would_wait_past_its_ttft_target_is_refused_with_decode_capacity(clock):
    control, dispatcher = stack(clock, max_num_seqs=1)
    control.decide(request("a"))  # 0.1 + 100 x 12.5 ms: a 1.35 s hold
    assert dispatcher._take("a")
    refusal = control.decide(request("b", slo="interactive", max_tokens=100))
    assert isinstance(refusal, Reject) and refusal.reason == RejectReason.DECODE_CAPACITY, refusal
    assert "decode pool" in refusal.message and refusal.retry_after_s > 0
    assert isinstance(control.decide(request("c", slo="batch")), Admit)  # 30 s is enough to wait for it


def test_a_stream_no_decode_worker_can_serve_at_its_target_is_refused_for_good(clock):
    control, _ = stack(clock, cost=StepCost(0.2, 0.001, 0.0, 0.0, 0.2, 0.001, 0.0))  # 200 ms steps, even idle
    refusal = control.decide(request("a", slo="interactive"))  # 100 ms between tokens: never
    assert isinstance(refusal, Reject) and refusal.reason == RejectReason.DECODE_CAPACITY
    assert refusal.retry_after_s is None and "inter-token target" in refusal.message
    assert isinstance(control.decide(request("b", slo="batch")), Admit)  # 1 s: fine


def test_the_tightest_target_among_the_streams_sets_the_capacity(clock):
    control, dispatcher = stack(clock)
    assert dispatcher.slots(request("x"), BATCH)[0] == 64  # 1 s steps: the batch limit
    control.decide(request("i", slo="interactive", max_tokens=10))
    assert dispatcher._take("i")
    assert dispatcher.slots(request("x"), BATCH)[0] == 36  # now every stream's step must fit 100 ms
    # An interactive stream from a prefill worker also waits for up to two steps for its second token: 50 ms each.
    assert dispatcher.slots(request("x"), INTERACTIVE)[0] == 16
    dispatcher.release("i", 0.5, "interactive")
    assert dispatcher.slots(request("x"), BATCH)[0] == 64


def test_admission_off_holds_no_stream_back(clock):
    control, dispatcher = stack(clock, max_num_seqs=1)
    control.enabled = False
    for rid in ("a", "b"):
        assert isinstance(control.decide(request(rid, slo="interactive")), Admit)
        assert dispatcher._take(rid)
    assert dispatcher.active == 2


def test_the_same_load_on_the_same_state_gets_the_same_decisions(make_clock):
    """Found by a new user: the same load of 200 batch streams was refused 105 times once and not at all later (the
    prefill rate's prior, replaced by a first measurement). Decisions are a function of the workers' reports and
    the router's own queue: the same load gets the same answers on a fresh router, and again on one whose earlier
    load has drained."""
    def load(control, dispatcher, clock) -> list[str]:
        decisions = []
        for i in range(40):
            slo = "interactive" if i % 3 == 0 else "batch"
            decision = control.decide(request(f"r{i}", slo=slo, max_tokens=20 + 10 * (i % 4)))
            decisions.append(decision.reason.value if isinstance(decision, Reject) else "admitted")
            if isinstance(decision, Admit) and dispatcher._take(f"r{i}"):
                control.release(f"r{i}")
            clock.advance(0.05)
        for i in range(40):  # drain: every stream ends, every queued request leaves
            if f"r{i}" in dispatcher._held:
                dispatcher.release(f"r{i}", 1.0, "batch" if i % 3 else "interactive")
            control.release(f"r{i}")
        return decisions

    def fresh():
        clock = make_clock()
        control, dispatcher = stack(clock, max_num_seqs=6)
        return control, dispatcher, clock

    first = load(*fresh())
    assert {"admitted", "decode_capacity"} <= set(first), first  # the load is past what the pool holds
    assert load(*fresh()) == first
    control, dispatcher, clock = fresh()
    load(control, dispatcher, clock)
    assert load(control, dispatcher, clock) == first  # the hold times released meanwhile change nothing


def test_measured_ttfts_correct_the_predictions_by_their_median_ratio(clock):
    """The workers' models miss what they cannot see (other work on their cores, the router's own time): the
    router scales its predictions by the median of measured / predicted TTFT over recent requests, so that one
    request slow for its own reasons does not move it."""
    control, dispatcher = stack(clock, max_num_seqs=1)
    ticket = control.decide(request("a"))
    assert ticket.predicted_ttft_s == pytest.approx(0.1)  # its prefill, on an idle pool
    for _ in range(control.MIN_CORRECTION_SAMPLES - 1):
        control.record_ttft(ticket, 0.2)
    assert control.ttft_correction == 1.0  # too few to say
    control.record_ttft(ticket, 5.0)  # one outlier
    assert control.ttft_correction == pytest.approx(2.0)  # the median: measured twice the prediction
    assert dispatcher._take("a")
    control.release("a")
    # Now a batch-class request waits for "a"'s slot: its predicted wait is doubled.
    hold = 0.1 + 100 * COST.decode_step_s(1, 90)
    assert control.decide(request("b")).predicted_wait_s == pytest.approx(2 * hold)


def test_the_correction_only_lengthens_predictions_and_never_refuses_a_prompt_for_good(clock):
    """A review's finds: a correction under 1 admitted a prompt whose own prefill passed the target, and one over 1
    refused a short prompt for good (no Retry-After) on an idle stack."""
    control, _ = stack(clock)
    ticket = control.decide(request("a"))
    control.release("a")
    for _ in range(control.MIN_CORRECTION_SAMPLES):
        control.record_ttft(ticket, 0.03)  # measured 0.3x the prediction
    assert control.ttft_correction == 1.0
    long_prompt = AdmissionRequest("long", 40, 10, "interactive", uncached_prompt_tokens=40, prefill_s=1.6)
    assert isinstance(control.decide(long_prompt), Reject)
    for _ in range(3 * control.MIN_CORRECTION_SAMPLES):
        control.record_ttft(ticket, 0.4)  # measured 4x, most of the recent ones
    assert control.ttft_correction == 4.0
    short = AdmissionRequest("short", 40, 10, "interactive", uncached_prompt_tokens=40, prefill_s=0.5)
    refusal = control.decide(short)  # 0.5 s predicted, 2 s corrected: refused, but not for good
    assert isinstance(refusal, Reject) and refusal.retry_after_s is not None
