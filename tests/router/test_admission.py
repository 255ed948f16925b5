"""SLO-aware admission: EDF order, Little's-law refusals and their Retry-After, token buckets, caps."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.router.admission import (
    BATCH,
    DEFAULT_SLO_CLASSES,
    INTERACTIVE,
    AdmissionController,
    AdmissionRequest,
    Admit,
    RateLimit,
    Reject,
    RejectReason,
    ServiceRates,
    SLOClass,
    TenantRateLimiter,
)
from tandem.router.dispatcher import Dispatcher


def request(rid, prompt=100, max_tokens=16, slo="interactive", api_key=None, uncached=None) -> AdmissionRequest:
    return AdmissionRequest(rid, prompt_tokens=prompt, max_tokens=max_tokens, slo_class=slo, api_key=api_key,
                            uncached_prompt_tokens=uncached)


def admitted(decision) -> Admit:
    assert isinstance(decision, Admit), decision
    return decision


def rejected(decision, reason: RejectReason) -> Reject:
    assert isinstance(decision, Reject) and decision.reason == reason, decision
    return decision


def with_in_flight(controller: AdmissionController, sizes: list[int], prefix="busy") -> None:
    """Admit and dispatch requests of these uncached sizes, so that they count as in flight."""
    for i, size in enumerate(sizes):
        admitted(controller.decide(request(f"{prefix}{i}", prompt=size, slo="batch")))
        assert controller.pop().request.request_id == f"{prefix}{i}"


def test_default_slo_classes():
    assert DEFAULT_SLO_CLASSES == {"interactive": INTERACTIVE, "batch": BATCH}
    assert (INTERACTIVE.ttft_s, INTERACTIVE.itl_s) == (1.0, 0.1)
    assert (BATCH.ttft_s, BATCH.itl_s) == (30.0, 1.0)
    assert INTERACTIVE.priority > BATCH.priority
    with pytest.raises(ValueError, match="ttft_s"):
        SLOClass("x", ttft_s=0, itl_s=1)
    with pytest.raises(ValueError, match="itl_s"):
        SLOClass("x", ttft_s=1, itl_s=float("nan"))


# -- EDF -------------------------------------------------------------------------------------------------


def test_dispatch_order_is_earliest_deadline_first(clock):
    control = AdmissionController(clock=clock)
    admitted(control.decide(request("batch-early", slo="batch")))  # deadline now + 30
    clock.advance(5)
    admitted(control.decide(request("interactive-1")))              # deadline now + 1, i.e. t0 + 6
    clock.advance(1)
    ticket = admitted(control.decide(request("interactive-2")))     # t0 + 7
    assert ticket.deadline_s == ticket.arrival_s + 1.0 == clock.now + 1.0
    clock.advance(40)
    admitted(control.decide(request("batch-late", slo="batch")))    # t0 + 76
    order = [control.pop().request.request_id for _ in range(4)]
    assert order == ["interactive-1", "interactive-2", "batch-early", "batch-late"]
    assert control.pop() is None


def test_equal_deadlines_go_by_priority():
    slow_vip = SLOClass("vip", ttft_s=30.0, itl_s=1.0, priority=5)
    control = AdmissionController(slo_classes={"batch": BATCH, "vip": slow_vip}, clock=lambda: 0.0)
    admitted(control.decide(request("b", slo="batch")))
    admitted(control.decide(request("v", slo="vip")))
    assert control.pop().request.request_id == "v"


# -- Little's law ----------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, derandomize=True)
@given(rate=st.integers(100, 20_000), workers=st.integers(1, 4),
       in_flight=st.lists(st.integers(0, 4000), max_size=4), queued=st.lists(st.integers(0, 4000), max_size=4),
       batch_queued=st.lists(st.integers(0, 4000), max_size=3), own_fraction=st.floats(0.0, 1.5))
def test_refused_exactly_when_predicted_wait_plus_prefill_exceeds_the_target(
        make_clock, rate, workers, in_flight, queued, batch_queued, own_fraction):
    clock = make_clock()
    rates = ServiceRates()  # no rate yet: everything below is admitted while the backlog is built
    control = AdmissionController(rates=rates, prefill_workers=workers, max_queue=64, clock=clock)
    with_in_flight(control, in_flight)
    for i, size in enumerate(queued):
        admitted(control.decide(request(f"q{i}", prompt=size)))  # interactive: deadlines before the newcomer's
    for i, size in enumerate(batch_queued):
        admitted(control.decide(request(f"b{i}", prompt=size, slo="batch")))  # deadlines after it
    clock.advance(0.5)
    rates.record_prefill(rate * 0.25, 0.25)

    own = int(own_fraction * rate)
    expected_wait = (sum(in_flight) + sum(queued)) / (rate * workers)
    own_time = own / rate
    assume(abs(expected_wait + own_time - 1.0) > 1e-9)
    decision = control.decide(request("new", prompt=own))
    if own_time > 1.0:  # a prompt too long for the target even on an idle pool: refused, and retrying cannot help
        assert rejected(decision, RejectReason.SLO_UNMEETABLE).retry_after_s is None
    elif expected_wait + own_time > 1.0:
        refusal = rejected(decision, RejectReason.SLO_UNMEETABLE)
        assert refusal.retry_after_s == pytest.approx(expected_wait - (1.0 - own_time))
        assert refusal.retry_after_s > 0
    else:
        assert admitted(decision).predicted_wait_s == pytest.approx(expected_wait)


def test_retry_after_shrinks_as_the_backlog_drains_and_is_long_enough(clock):
    control = AdmissionController(rates=ServiceRates(), prefill_workers=2, clock=clock)
    with_in_flight(control, [3399, 1, 1600])  # built while no rate is known, so nothing is refused
    control.rates.record_prefill(1000, 1.0)
    # wait = 5000 / 2000 = 2.5 s; own prefill 200 / 1000 = 0.2 s; the target leaves 0.8 s of waiting.
    first = rejected(control.decide(request("x", prompt=200)), RejectReason.SLO_UNMEETABLE)
    assert first.retry_after_s == pytest.approx(1.7)  # 3400 tokens to drain at 2000 tokens/s
    assert control.release("busy0")  # 3399 of those 3400 tokens done
    second = rejected(control.decide(request("x", prompt=200)), RejectReason.SLO_UNMEETABLE)
    assert 0 < second.retry_after_s < first.retry_after_s
    assert second.retry_after_s == pytest.approx(0.0005)
    assert control.release("busy1")  # the last token: the backlog now fits exactly
    assert admitted(control.decide(request("x", prompt=200))).predicted_wait_s == pytest.approx(0.8)


def test_a_batch_backlog_does_not_block_interactive_requests(clock):
    rates = ServiceRates()
    control = AdmissionController(rates=rates, clock=clock)
    for i in range(10):
        admitted(control.decide(request(f"b{i}", prompt=5000, slo="batch")))
    rates.record_prefill(1000, 1.0)  # 50 s of batch work queued
    admitted(control.decide(request("chat", prompt=300)))
    refusal = rejected(control.decide(request("b-new", prompt=1000, slo="batch")), RejectReason.SLO_UNMEETABLE)
    assert refusal.retry_after_s == pytest.approx(50.3 + 1.0 - 30.0)  # includes the interactive request ahead


def test_more_prefill_workers_shorten_the_predicted_wait(clock):
    control = AdmissionController(rates=ServiceRates(), clock=clock)
    with_in_flight(control, [4000])
    control.rates.record_prefill(1000, 1.0)
    rejected(control.decide(request("a", prompt=100)), RejectReason.SLO_UNMEETABLE)
    control.prefill_workers = 8  # 4000 / 8000 = 0.5 s, + 0.1 s own
    assert admitted(control.decide(request("a", prompt=100))).predicted_wait_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="prefill_workers"):
        control.prefill_workers = 0


def test_only_uncached_tokens_count_as_prefill_work(clock):
    control = AdmissionController(rates=ServiceRates(), clock=clock)
    with_in_flight(control, [500])
    control.rates.record_prefill(1000, 1.0)  # 0.5 s of work ahead of anything new
    rejected(control.decide(request("cold", prompt=600)), RejectReason.SLO_UNMEETABLE)
    assert control.queued_tokens == 0 and control.in_flight_tokens == 500
    # Same length, but the router expects 500 tokens of it to be in the chosen worker's prefix cache.
    admitted(control.decide(request("warm", prompt=600, uncached=100)))
    assert control.queued_tokens == 100


def test_a_prompt_too_long_for_its_class_is_refused_on_an_idle_pool_without_a_retry_after(clock):
    control = AdmissionController(rates=ServiceRates(initial_prefill_tps=1000.0), clock=clock)
    refusal = rejected(control.decide(request("long", prompt=3000)), RejectReason.SLO_UNMEETABLE)
    assert refusal.retry_after_s is None and "the prompt alone" in refusal.message
    assert admitted(control.decide(request("long", prompt=3000, slo="batch"))).predicted_wait_s == 0.0


def test_without_a_rate_nothing_is_refused_for_its_slo(clock):
    control = AdmissionController(clock=clock)
    with_in_flight(control, [10**6])
    ticket = admitted(control.decide(request("x", prompt=10**5)))
    assert ticket.predicted_wait_s is None


# -- token buckets ---------------------------------------------------------------------------------------


def test_rate_limited_with_retry_after_until_refill(clock):
    limiter = TenantRateLimiter(api_keys={"sk-acme": "acme", "sk-globex": "globex"},
                                limits={"acme": RateLimit(tokens_per_s=100, burst=1000)}, clock=clock)
    control = AdmissionController(rate_limiter=limiter, clock=clock)
    assert admitted(control.decide(request("a1", prompt=500, max_tokens=100, api_key="sk-acme"))).tenant == "acme"
    refusal = rejected(control.decide(request("a2", prompt=500, max_tokens=100, api_key="sk-acme")),
                       RejectReason.RATE_LIMITED)
    assert refusal.retry_after_s == pytest.approx(2.0)  # 600 needed, 400 left, 100 tokens/s
    # Another tenant is not affected, and the refusal charged nothing.
    admitted(control.decide(request("g1", prompt=500, max_tokens=100, api_key="sk-globex")))
    clock.advance(1.0)
    assert rejected(control.decide(request("a2", prompt=500, max_tokens=100, api_key="sk-acme")),
                    RejectReason.RATE_LIMITED).retry_after_s == pytest.approx(1.0)
    clock.advance(1.0)
    admitted(control.decide(request("a2", prompt=500, max_tokens=100, api_key="sk-acme")))


def test_refusals_for_other_reasons_are_not_charged(clock):
    limiter = TenantRateLimiter(default_limit=RateLimit(tokens_per_s=1, burst=1000), clock=clock)
    control = AdmissionController(rate_limiter=limiter, rates=ServiceRates(initial_prefill_tps=100.0), clock=clock)
    admitted(control.decide(request("small", prompt=50, max_tokens=400)))  # 0.5 s of prefill
    assert limiter.bucket("default").level == 550
    rejected(control.decide(request("big", prompt=80, max_tokens=400)), RejectReason.SLO_UNMEETABLE)
    assert limiter.bucket("default").level == 550


# -- queue and caps --------------------------------------------------------------------------------------


def test_queue_full_until_a_request_leaves(clock):
    control = AdmissionController(max_queue=2, rates=ServiceRates(initial_prefill_tps=1000.0), clock=clock)
    admitted(control.decide(request("a", prompt=100)))
    admitted(control.decide(request("b", prompt=300)))
    refusal = rejected(control.decide(request("c", prompt=10)), RejectReason.QUEUE_FULL)
    assert refusal.retry_after_s == pytest.approx(0.2)  # one average queued request's prefill (200 tokens)
    control.pop()
    admitted(control.decide(request("c", prompt=10)))
    assert control.release("c") and not control.release("c")  # a cancelled queued request frees its slot
    admitted(control.decide(request("d", prompt=10)))


def test_queue_full_says_when_to_retry_before_any_rate_is_measured(clock):
    control = AdmissionController(max_queue=1, clock=clock)
    admitted(control.decide(request("a", prompt=100)))
    assert rejected(control.decide(request("b", prompt=10)), RejectReason.QUEUE_FULL).retry_after_s == 1.0


@pytest.mark.parametrize("prompt, max_tokens, reason", [
    (4097, 16, RejectReason.INPUT_TOO_LONG),
    (4096, 1025, RejectReason.MAX_TOKENS_TOO_LARGE),
    (4097, 1025, RejectReason.INPUT_TOO_LONG),
])
def test_caps(clock, prompt, max_tokens, reason):
    control = AdmissionController(max_input_tokens=4096, max_output_tokens=1024, clock=clock)
    refusal = rejected(control.decide(request("r", prompt=prompt, max_tokens=max_tokens)), reason)
    assert refusal.retry_after_s is None  # retrying the same request cannot help
    admitted(control.decide(request("ok", prompt=4096, max_tokens=1024)))  # the caps themselves are allowed


def test_reasons_come_in_order_caps_rate_queue_slo(clock):
    limiter = TenantRateLimiter(default_limit=RateLimit(1, 100), clock=clock)
    control = AdmissionController(max_queue=1, max_input_tokens=1000, max_output_tokens=100, rate_limiter=limiter,
                                  rates=ServiceRates(initial_prefill_tps=10.0), clock=clock)
    admitted(control.decide(request("fill", prompt=5, max_tokens=5)))  # queue now full, 90 tokens left
    assert control.decide(request("r", prompt=2000, max_tokens=500)).reason == RejectReason.INPUT_TOO_LONG
    assert control.decide(request("r", prompt=900, max_tokens=500)).reason == RejectReason.MAX_TOKENS_TOO_LARGE
    assert control.decide(request("r", prompt=900, max_tokens=100)).reason == RejectReason.RATE_LIMITED
    assert control.decide(request("r", prompt=40, max_tokens=40)).reason == RejectReason.QUEUE_FULL
    control.pop()
    assert control.decide(request("r", prompt=40, max_tokens=40)).reason == RejectReason.SLO_UNMEETABLE
    assert control.decide(request("r", prompt=6, max_tokens=40)).reason == RejectReason.SLO_UNMEETABLE  # 0.5 + 0.6
    admitted(control.decide(request("r", prompt=5, max_tokens=40)))  # 0.5 + 0.5: exactly on target


def test_bad_requests_raise(clock):
    control = AdmissionController(clock=clock)
    with pytest.raises(ValueError, match="unknown SLO class"):
        control.decide(request("r", slo="platinum"))
    admitted(control.decide(request("r")))
    with pytest.raises(ValueError, match="already admitted"):
        control.decide(request("r"))
    with pytest.raises(ValueError, match="prompt_tokens"):
        request("x", prompt=-1)
    with pytest.raises(ValueError, match="uncached_prompt_tokens"):
        request("x", prompt=10, uncached=11)
    with pytest.raises(ValueError, match="named"):
        AdmissionController(slo_classes={"fast": INTERACTIVE})
    with pytest.raises(ValueError, match="max_input_tokens"):
        AdmissionController(max_input_tokens=0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.booleans()), max_size=30))
def test_in_flight_tokens_are_those_dispatched_and_not_released(make_clock, requests):
    """The running total admission reads equals the sum over what is in flight, however requests come and go
    (released once, twice, or never)."""
    control = AdmissionController(clock=make_clock())
    with_in_flight(control, [size for size, _ in requests])
    for i, (_, release) in enumerate(requests):
        if release:
            assert control.release(f"busy{i}")
            assert not control.release(f"busy{i}")  # a second release changes nothing
    assert control.in_flight_tokens == sum(size for size, release in requests if not release)


def test_with_every_dispatch_slot_held_a_request_waits_for_one_and_is_refused_when_that_is_too_long(clock):
    """--max-in-flight 2, both slots held by streams that hold one 3 s: an idle prefill pool does not make an
    interactive request's 1 s TTFT reachable. One second into their holds, the next slot frees in 2 s, the one after
    at the same time, and the third one hold later."""
    control = AdmissionController(rates=ServiceRates(initial_prefill_tps=1000.0), clock=clock)
    dispatcher = Dispatcher(control, limit=2, metrics=None, clock=clock)

    def hold(rid: str) -> None:
        admitted(control.decide(request(rid, prompt=10, slo="batch")))
        assert dispatcher._take(rid)
        control.release(rid)  # its prefill is done; its slot is held until dispatcher.release

    hold("a")
    hold("b")
    admitted(control.decide(request("early", prompt=10)))  # both slots held, but no hold time known: no prediction
    control.release("early")
    for rid in ("a", "b"):
        dispatcher.release(rid, 3.0, "batch")  # two streams held their slots 3 s each
    hold("c")
    hold("d")  # two more hold them now, each predicted to for 3 s
    clock.advance(1.0)
    refusal = rejected(control.decide(request("late", prompt=10)), RejectReason.DISPATCH_SLOTS)
    assert refusal.retry_after_s == pytest.approx(2.0 - (1.0 - 0.01))
    assert "--max-in-flight" in refusal.message
    control.rates = ServiceRates(initial_prefill_tps=10.0)  # a slow pool: 3 s of prefill backlog
    with_in_flight(control, [30])
    rejected(control.decide(request("slow", prompt=2)), RejectReason.SLO_UNMEETABLE)  # the longer wait names it
    control.rates = ServiceRates(initial_prefill_tps=1000.0)
    assert admitted(control.decide(request("patient", prompt=10, slo="batch"))).predicted_wait_s == pytest.approx(2.0)
    slo = INTERACTIVE
    assert dispatcher.wait_s(request("x"), slo, queued_ahead=1)[0] == pytest.approx(2.0)  # the other 2 s one
    assert dispatcher.wait_s(request("x"), slo, queued_ahead=2)[0] == pytest.approx(5.0)  # one hold after that
    dispatcher.release("c", 1.0, "batch")  # a slot free: no wait for it
    assert dispatcher.wait_s(request("x"), slo, queued_ahead=0) == (0.0, RejectReason.DISPATCH_SLOTS)
