"""Token buckets charged in model tokens, and the API key -> tenant mapping."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.admission.token_bucket import DEFAULT_TENANT, RateLimit, TenantRateLimiter, TokenBucket


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rate=st.floats(1.0, 10_000.0), burst=st.floats(10.0, 100_000.0), fraction=st.floats(0.0, 1.0),
       elapsed=st.floats(0.0, 100.0))
def test_refills_at_the_configured_rate_up_to_the_burst(make_clock, rate, burst, fraction, elapsed):
    clock = make_clock()
    bucket = TokenBucket(RateLimit(rate, burst), clock)
    assert bucket.level == burst  # starts full
    taken = fraction * burst
    bucket.consume(taken)
    clock.advance(elapsed)
    assert bucket.level == pytest.approx(min(burst, burst - taken + rate * elapsed), rel=1e-9, abs=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rate=st.floats(1.0, 10_000.0), burst=st.floats(10.0, 100_000.0), fraction=st.floats(0.01, 1.0))
def test_wait_is_the_time_until_enough_has_refilled(make_clock, rate, burst, fraction):
    clock = make_clock()
    bucket = TokenBucket(RateLimit(rate, burst), clock)
    bucket.consume(burst)
    charge = fraction * burst
    wait = bucket.wait_s(charge)
    assert wait == pytest.approx(charge / rate, rel=1e-9)
    clock.advance(wait * 0.99)
    assert bucket.wait_s(charge) > 0
    clock.advance(wait * 0.01)
    assert bucket.wait_s(charge) == 0.0
    bucket.consume(charge)


def test_consume_refuses_early_and_oversized_charges_go_into_debt(clock):
    bucket = TokenBucket(RateLimit(tokens_per_s=100, burst=1000), clock)
    bucket.consume(900)
    with pytest.raises(ValueError, match="cannot take"):
        bucket.consume(200)
    assert bucket.level == 100  # the refused charge took nothing
    clock.advance(9.0)  # full again
    assert bucket.wait_s(1500) == 0.0  # bigger than the burst: allowed once the bucket is full
    bucket.consume(1500)
    assert bucket.level == -500
    assert bucket.wait_s(10) == pytest.approx(5.1)  # the debt is paid off at the refill rate first


def test_clock_stepping_back_does_not_drain(clock):
    bucket = TokenBucket(RateLimit(10, 100), clock)
    bucket.consume(50)
    clock.advance(-30)
    assert bucket.level == 50


def test_tenants_have_separate_buckets_and_unknown_keys_share_the_default(clock):
    limiter = TenantRateLimiter(
        api_keys={"sk-a1": "acme", "sk-a2": "acme", "sk-g": "globex"},
        limits={"acme": RateLimit(10, 100), "free": RateLimit(1, 10)},
        default_limit=RateLimit(1, 50),
        clock=clock,
    )
    assert limiter.tenant_for("sk-a1") == limiter.tenant_for("sk-a2") == "acme"
    assert limiter.tenant_for("sk-unknown") == limiter.tenant_for(None) == DEFAULT_TENANT
    limiter.consume("acme", 100)
    assert limiter.wait_s("acme", 20) == pytest.approx(2.0)
    assert limiter.wait_s("globex", 50) == 0.0  # globex has no own limit: the default one, untouched
    assert limiter.wait_s("globex", 51) == 0.0  # ...and over-burst charges wait only for a full bucket
    limiter.consume("globex", 50)
    assert limiter.wait_s("globex", 1) == pytest.approx(1.0)
    assert limiter.bucket("acme").limit == RateLimit(10, 100)


def test_no_default_limit_means_unlimited(clock):
    limiter = TenantRateLimiter(limits={"acme": RateLimit(10, 100)}, clock=clock)
    assert limiter.bucket("other") is None
    limiter.consume("other", 10**9)
    assert limiter.wait_s("other", 10**9) == 0.0


@pytest.mark.parametrize("rate, burst", [(0, 10), (-1, 10), (10, 0), (float("inf"), 10)])
def test_bad_limits(rate, burst):
    with pytest.raises(ValueError):
        RateLimit(rate, burst)
