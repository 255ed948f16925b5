"""The planner policy `recommend()`: hysteresis, no oscillation, cooldowns, min/max and the GPU budget."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.planning.policy import FleetState, MetricsWindow, PlannerLimits, recommend, replicas_needed

# One replica of each pool serves 10,000 prompt tokens/s or 1,000 output tokens/s; at 80% utilisation and
# 2,000 in / 200 out tokens per request, 4 RPS needs exactly 1 prefill and 1 decode replica.
LIMITS = PlannerLimits(target_utilization=0.8, hysteresis=0.2, scale_up_cooldown_s=60, scale_down_cooldown_s=300)


def window(rps: float, t: float = 10_000.0, **kw) -> MetricsWindow:
    values = dict(end_s=t, arrival_rps=rps, mean_input_tokens=2000, mean_output_tokens=200,
                  prefill_tok_s_per_replica=10_000, decode_tok_s_per_replica=1_000)
    values.update(kw)
    return MetricsWindow(**values)


def test_needs_follow_the_formula():
    assert replicas_needed(window(4.0), LIMITS) == pytest.approx((1.0, 1.0))
    assert replicas_needed(window(40.0), LIMITS) == pytest.approx((10.0, 10.0))
    # A backlog of 48,000 queued prompt tokens is drained over 60 s: 800 tok/s more, 0.1 replica.
    assert replicas_needed(window(40.0, prefill_backlog_tokens=48_000), LIMITS)[0] == pytest.approx(10.1)


def test_a_shift_moves_replicas_only_past_the_hysteresis():
    current = FleetState(prefill=10, decode=10, last_change_s=0.0)
    small = recommend(window(40.0 * 1.15), current, LIMITS)  # +15%: inside the 20% band
    assert (small.prefill, small.decode) == (10, 10) and not small.changes(current)
    assert "holds 10" in small.reason
    big = recommend(window(40.0 * 1.5), current, LIMITS)  # +50%: 15 replicas needed
    assert (big.prefill, big.decode) == (15, 15)
    assert "prefill 10->15" in big.reason
    # Once moved, the same load keeps it there.
    after = FleetState(15, 15, last_change_s=10_000.0)
    assert not recommend(window(60.0, t=10_600.0), after, LIMITS).changes(after)
    down = recommend(window(40.0 * 0.7), current, LIMITS)  # -30%: 7 needed
    assert (down.prefill, down.decode) == (7, 7)


def test_pools_move_independently():
    current = FleetState(prefill=10, decode=10)
    rec = recommend(window(40.0, mean_output_tokens=400), current, LIMITS)  # decode work doubles
    assert (rec.prefill, rec.decode) == (10, 20)


def _run(loads, start: FleetState, limits=LIMITS, tick_s=60.0):
    """Feed a sequence of measured loads one window per tick, applying each recommendation."""
    state, history = start, []
    for i, rps in enumerate(loads):
        t = 1_000.0 + i * tick_s
        rec = recommend(window(rps, t=t), state, limits)
        if rec.changes(state):
            state = FleetState(rec.prefill, rec.decode, last_change_s=t)
        history.append((state.prefill, state.decode))
    return history


def test_constant_noisy_load_never_oscillates():
    rng = np.random.default_rng(3)
    for level in (4.0, 13.0, 41.0, 97.0):  # around 1, 3.25, 10.25 and 24.25 replicas
        loads = level * (1 + rng.uniform(-0.06, 0.06, size=600))
        for start in (FleetState(1, 1), FleetState(60, 60)):
            history = _run(loads, start)
            changes = [i for i in range(1, len(history)) if history[i] != history[i - 1]]
            first = history[0] != (start.prefill, start.decode)
            assert len(changes) + first <= 1, (level, start, changes)


def test_cooldowns_hold_moves_back():
    current = FleetState(prefill=10, decode=10, last_change_s=10_000.0)
    early_up = recommend(window(80.0, t=10_030.0), current, LIMITS)  # 30 s after a change, 60 s cooldown
    assert (early_up.prefill, early_up.decode) == (10, 10) and "cooldown, 30 s left" in early_up.reason
    assert recommend(window(80.0, t=10_061.0), current, LIMITS).prefill == 20
    early_down = recommend(window(8.0, t=10_200.0), current, LIMITS)  # scale-down waits 300 s
    assert early_down.prefill == 10
    assert recommend(window(8.0, t=10_301.0), current, LIMITS).prefill == 2


def test_min_and_max_per_pool():
    limits = PlannerLimits(min_prefill=2, max_prefill=6, min_decode=3, max_decode=8, scale_up_cooldown_s=0,
                           scale_down_cooldown_s=0)
    high = recommend(window(400.0), FleetState(4, 4), limits)
    assert (high.prefill, high.decode) == (6, 8) and "clamped" in high.reason
    idle = recommend(window(0.0, mean_input_tokens=0, mean_output_tokens=0), FleetState(4, 4), limits)
    assert (idle.prefill, idle.decode) == (2, 3)


def test_gpu_budget_caps_the_fleet_and_keeps_the_balance():
    limits = PlannerLimits(prefill_gpus_per_replica=4, decode_gpus_per_replica=4, gpu_budget=64,
                           scale_up_cooldown_s=0, scale_down_cooldown_s=0)
    # 3x as much decode as prefill work, 40 replicas wanted: 16 fit, split about 1:3.
    rec = recommend(window(40.0, mean_output_tokens=600), FleetState(2, 2), limits)
    assert (rec.prefill + rec.decode) * 4 <= 64
    assert (rec.prefill, rec.decode) == (4, 12)
    assert "budget" in rec.reason
    # A fleet already over a lowered budget is trimmed at once, even within a cooldown.
    tight = PlannerLimits(prefill_gpus_per_replica=4, decode_gpus_per_replica=4, gpu_budget=32,
                          scale_down_cooldown_s=10_000)
    trimmed = recommend(window(40.0, t=1.0), FleetState(10, 10, last_change_s=0.0), tight)
    assert trimmed.prefill + trimmed.decode == 8


def test_gpu_budget_counts_each_pools_tensor_parallel_size():
    """Prefill workers of TP 1 and decode workers of TP 4: the budget holds replicas x TP per pool."""
    limits = PlannerLimits(prefill_gpus_per_replica=1, decode_gpus_per_replica=4, gpu_budget=40,
                           scale_up_cooldown_s=0, scale_down_cooldown_s=0)
    assert limits.gpus(4, 9) == 40
    # Needs of 10 + 10 replicas hold 10 x 1 + 10 x 4 = 50 GPUs: scaled by 0.8 to 8 + 8, 40 GPUs.
    rec = recommend(window(40.0), FleetState(2, 2), limits)
    assert (rec.prefill, rec.decode) == (8, 8) and limits.gpus(rec.prefill, rec.decode) == 40
    assert "needs scaled by 0.80 to fit the 40-GPU budget" in rec.reason
    # A fleet over budget is trimmed by GPUs, not replicas: 10 + 10 hold 50 GPUs.
    trimmed = recommend(window(40.0, t=1.0), FleetState(10, 10, last_change_s=0.0),
                        PlannerLimits(prefill_gpus_per_replica=1, decode_gpus_per_replica=4, gpu_budget=40,
                                      scale_down_cooldown_s=10_000))
    assert (trimmed.prefill, trimmed.decode) == (8, 8) and "to 8+8 replicas (40 GPUs) for the 40-GPU budget" in \
        trimmed.reason
    with pytest.raises(ValueError, match=r"the minimum pools \(1 x 1 \+ 3 x 4 GPUs\) exceed the GPU budget of 12"):
        PlannerLimits(min_prefill=1, min_decode=3, decode_gpus_per_replica=4, gpu_budget=12)


@settings(max_examples=300, deadline=None)
@given(rps=st.floats(0, 500), out_tokens=st.floats(1, 2000), cur_p=st.integers(0, 50), cur_d=st.integers(0, 50),
       min_p=st.integers(0, 4), min_d=st.integers(0, 4), span=st.integers(0, 40), gpr=st.integers(1, 8),
       gpr_d=st.integers(1, 8), budget_extra=st.one_of(st.none(), st.integers(0, 200)), since=st.floats(0, 1000))
def test_limits_always_hold(rps, out_tokens, cur_p, cur_d, min_p, min_d, span, gpr, gpr_d, budget_extra, since):
    budget = None if budget_extra is None else min_p * gpr + min_d * gpr_d + budget_extra
    limits = PlannerLimits(min_prefill=min_p, max_prefill=min_p + span, min_decode=min_d, max_decode=min_d + span,
                           prefill_gpus_per_replica=gpr, decode_gpus_per_replica=gpr_d, gpu_budget=budget)
    rec = recommend(window(rps, t=1000.0 + since, mean_output_tokens=out_tokens),
                    FleetState(cur_p, cur_d, last_change_s=1000.0), limits)
    assert min_p <= rec.prefill <= min_p + span
    assert min_d <= rec.decode <= min_d + span
    if budget is not None:
        assert rec.prefill * gpr + rec.decode * gpr_d <= budget


def test_bad_limits_and_windows_are_refused():
    with pytest.raises(ValueError, match="min_prefill <= max_prefill"):
        PlannerLimits(min_prefill=5, max_prefill=2)
    with pytest.raises(ValueError, match="exceed the GPU budget"):
        PlannerLimits(min_prefill=2, min_decode=2, prefill_gpus_per_replica=8, decode_gpus_per_replica=8,
                      gpu_budget=16)
    with pytest.raises(ValueError, match="hysteresis"):
        PlannerLimits(hysteresis=1.5)
    with pytest.raises(ValueError, match="arrival_rps"):
        window(-1.0)
    with pytest.raises(ValueError, match="decode_tok_s_per_replica must be > 0"):
        window(1.0, decode_tok_s_per_replica=0)
