"""Service-rate estimates: measured prefill and decode throughput, exponentially smoothed over the time measured."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.admission.rates import EWMARate, ServiceRates


@settings(max_examples=50, deadline=None, derandomize=True)
@given(rate=st.floats(1.0, 1e6), durations=st.lists(st.floats(0.001, 10.0), min_size=1, max_size=20),
       half_life=st.floats(0.1, 100.0))
def test_steady_rate_is_measured_exactly(rate, durations, half_life):
    estimate = EWMARate(half_life)
    for seconds in durations:
        estimate.record(rate * seconds, seconds)
    assert estimate.tokens_per_s == pytest.approx(rate, rel=1e-9)


def test_prior_until_first_measurement_then_tracks_a_change():
    estimate = EWMARate(half_life_s=5.0, initial_tps=5000.0)
    assert estimate.tokens_per_s == 5000.0
    estimate.record(1000, 1.0)
    assert estimate.tokens_per_s == 1000.0  # the first measurement replaces the prior outright
    previous = estimate.tokens_per_s
    for _ in range(40):
        estimate.record(3000, 1.0)  # the workers got 3x faster
        assert previous < estimate.tokens_per_s <= 3000
        previous = estimate.tokens_per_s
    assert estimate.tokens_per_s == pytest.approx(3000, rel=0.01)
    assert estimate.samples == 41


def test_measurements_count_by_the_work_they_cover():
    estimate = EWMARate(half_life_s=2.0)
    estimate.record(4000, 1.0)  # a long prompt at 4000 tokens/s
    estimate.record(10, 0.01)   # a tiny one dominated by fixed overhead: 1000 tokens/s
    kept = 0.5 ** (0.01 / 2.0)
    # (4000 kept + 10) / (1.0 kept + 0.01) ~ 3970: an average of per-sample tokens/s would have said 2500.
    assert estimate.tokens_per_s == pytest.approx((4000 * kept + 10) / (kept + 0.01))
    assert estimate.tokens_per_s > 3900


@pytest.mark.parametrize("owner_done", ["first", "last"])
def test_a_burst_done_in_one_step_counts_as_the_work_the_worker_did_whatever_order_it_is_recorded_in(owner_done):
    """Sixteen prefills in flight together on one worker, done in one step after 0.6 s: one computed a shared
    316-token prompt, the 15 others 28 tokens each after it. Each is charged a sixteenth of the 0.6 s, and the
    worker did 736 tokens in 0.6 s. Decaying per measurement (alpha 0.2), the rate came out far below that with
    the long one recorded first and far above with it recorded last."""
    estimate = EWMARate(initial_tps=1000.0)
    estimate.record(100, 0.1)  # an earlier prefill at 1,000 tokens/s
    burst = [316] + [28] * 15 if owner_done == "first" else [28] * 15 + [316]
    for tokens in burst:
        estimate.record(tokens, 0.6 / 16)
    assert estimate.tokens_per_s == pytest.approx(736 / 0.6, rel=0.06)  # the earlier 0.1 s at 1,000 counts a little


def test_service_rates_keep_prefill_and_decode_apart():
    rates = ServiceRates(initial_prefill_tps=8000.0)
    assert rates.prefill_tps == 8000.0 and rates.decode_tps is None
    rates.record_decode(50, 2.0)
    rates.record_prefill(3000, 0.5)
    assert rates.decode_tps == 25.0 and rates.prefill_tps == 6000.0


@pytest.mark.parametrize("tokens, seconds", [(-1, 1.0), (10, -1.0), (math.nan, 1.0), (10, math.inf)])
def test_bad_measurements(tokens, seconds):
    with pytest.raises(ValueError):
        EWMARate().record(tokens, seconds)


@pytest.mark.parametrize("kwargs", [{"half_life_s": 0.0}, {"half_life_s": -1.0}, {"half_life_s": math.inf},
                                    {"initial_tps": 0.0}, {"initial_tps": -3.0}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        EWMARate(**kwargs)


def _worker_rate(finishes: list[tuple[float, float]], tokens: int, first: int = 0, last: int | None = None) -> float:
    """The rate estimated from prefills of `tokens` each on one worker, started and done at the given times (only
    the measurements of prefills first to last, when given)."""
    from tandem.router.pool import Worker

    worker, estimate, marks = Worker("http://w"), EWMARate(), {}
    events = sorted([(start, 1, i) for i, (start, _) in enumerate(finishes)] +
                    [(done, 0, i) for i, (_, done) in enumerate(finishes)])  # a start before a done at one time
    for now, starts, i in events:
        if starts:
            marks[i] = worker.prefill_started(now)
        else:
            charged = worker.prefill_done(now, marks[i])
            if first <= i and (last is None or i < last):
                estimate.record(tokens, charged)
    assert worker.prefills == 0
    return estimate.tokens_per_s


def test_prefills_batched_together_share_their_worker_busy_time():
    """Four 100-token prompts prefilled in one engine step of 0.1 s: the worker serves 4,000 tokens/s. Timed from
    each request's dispatch, every one took 0.1 s: 1,000 tokens/s, a quarter of what the worker does."""
    batched = [(step * 0.1, step * 0.1 + 0.1 - 1e-6 * i) for step in range(5) for i in range(4)]
    assert _worker_rate(batched, 100) == pytest.approx(4000, rel=0.01)


def test_prefills_one_after_another_are_each_charged_their_own_time():
    """A worker that prefills one 100-token prompt per 0.1 s, four in flight at any time (one dispatched as one
    is done): 1,000 tokens/s. Timed from dispatch, each took 0.4 s: 250 tokens/s."""
    queued = [(max(0, i - 3) * 0.1, (i + 1) * 0.1) for i in range(100)]
    # Not the first three, charged less while the queue filled, nor the last three, as it drains.
    assert _worker_rate(queued, 100, first=3, last=97) == pytest.approx(1000, rel=0.01)


def test_time_the_worker_spent_idle_is_charged_to_no_one():
    spaced = [(0.0, 0.1), (5.0, 5.1), (9.0, 9.1)]
    assert _worker_rate(spaced, 100) == pytest.approx(1000, rel=0.01)


def test_a_first_measurement_of_no_time_gives_no_rate():
    estimate = EWMARate(initial_tps=500.0)
    estimate.record(10, 0.0)
    assert estimate.samples == 0 and estimate.tokens_per_s == 500.0


def test_one_long_measurement_moves_the_rate_without_wiping_its_history():
    """A prefill charged 30 s for 100 tokens (stalled, or waiting in its engine) after a steady 1,000 tokens/s: it
    counts as 2 s of work at its own rate, and the history keeps half its weight. Counted whole, it replaced the
    history, and admission refused nearly everything until more measurements came."""
    estimate = EWMARate(half_life_s=2.0)
    for _ in range(20):
        estimate.record(1000, 1.0)
    estimate.record(100, 30.0)
    history = 1 / (1 - 0.5 ** 0.5)  # seconds of work a steady 1 s per measurement keeps, at a half-life of 2 s
    assert estimate.tokens_per_s == pytest.approx((1000 * history * 0.5 + 100 * 2 / 30) / (history * 0.5 + 2),
                                                  rel=0.01)
    assert estimate.tokens_per_s > 400


def test_a_measurement_of_no_time_adds_nothing():
    estimate = EWMARate()
    estimate.record(1000, 1.0)
    estimate.record(500, 0.0)
    assert estimate.tokens_per_s == 1000.0 and estimate.samples == 1
