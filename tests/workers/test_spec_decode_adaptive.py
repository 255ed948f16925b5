"""Adaptive speculation: per-sequence acceptance history, and the step cost model deciding what is verified."""

from __future__ import annotations

from tandem.metrics import EngineMetrics
from tandem.step_cost import StepCost
from tandem.workers.engine.spec_decode.adaptive import (
    FIRST_PAUSE,
    LONGEST_PAUSE,
    AcceptanceHistory,
    plan_drafts,
    worth_alone,
)
from tandem.workers.engine.spec_decode.stats import SpecDecodeStats


def decode_cost(base_s: float, row_s: float, pair_s: float = 0.0) -> StepCost:
    """A step cost model whose decode steps cost base_s + row_s per row computed (+ pair_s per key attended)."""
    return StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=base_s,
                    decode_sequence_s=row_s, decode_pair_s=pair_s)


# Memory-bound: the step reads every weight once whatever it computes, a row more is cheap (a GPU at low batch).
CHEAP_ROWS = decode_cost(base_s=0.020, row_s=0.0005)
# Compute-bound: every row costs nearly a whole step (a CPU, or any device at a large batch).
DEAR_ROWS = decode_cost(base_s=0.002, row_s=0.004)


def test_drafts_pay_where_a_step_costs_little_more_per_row():
    assert plan_drafts(CHEAP_ROWS, [100], [0.8], [4]) == [4]
    assert plan_drafts(CHEAP_ROWS, [100] * 8, [0.8] * 8, [4] * 8) == [4] * 8


def test_drafts_do_not_pay_where_rows_cost_a_step_each():
    # At batch 1: 1 token in 6 ms; a draft at 0.6 adds 0.6 tokens for 4 ms: 0.15 a ms against 0.17 a ms.
    assert plan_drafts(DEAR_ROWS, [100], [0.6], [4]) == [0]
    # A likely draft still pays (0.8 tokens for 4 ms beats 1 for 6 ms), its less likely follower not: 0.64 for
    # 4 ms is below the step's 1.8 for 10 ms.
    assert plan_drafts(DEAR_ROWS, [100], [0.8], [4]) == [1]


def test_the_batch_turns_speculation_off_when_verifying_costs_more_than_it_saves():
    model = decode_cost(base_s=0.020, row_s=0.002)
    assert plan_drafts(model, [100], [0.5], [4]) == [2]  # alone: 1 token in 22 ms; drafts at 0.5 / 2 ms pay
    # 32 decodes: 32 tokens in 84 ms, 0.38 a ms; a draft at 0.5 makes 0.25 a ms: the step verifies none.
    assert plan_drafts(model, [100] * 32, [0.5] * 32, [4] * 32) == [0] * 32
    # The likelier drafts of a batch are verified first: where only some pay, they are those.
    planned = plan_drafts(model, [100] * 16, [0.95] * 4 + [0.3] * 12, [4] * 16)
    assert planned[4:] == [0] * 12 and all(k > 0 for k in planned[:4])


def test_the_plan_keeps_draft_order_and_limits():
    assert plan_drafts(CHEAP_ROWS, [10, 10, 10], [1.0, 0.9, 0.0], [3, 0, 4]) == [3, 0, 0]
    # The attention term counts: at long contexts each row reads more keys and drafts pay less.
    model = decode_cost(base_s=0.010, row_s=0.0005, pair_s=1e-6)
    assert plan_drafts(model, [100], [0.9], [4]) == [4]
    assert plan_drafts(model, [20_000], [0.9], [4]) == [2]


def test_without_a_model_history_alone_decides():
    assert plan_drafts(None, [10, 10], [0.9, 0.2], [4, 4]) == [4, 0]
    assert plan_drafts(None, [10], [0.6], [4]) == [2]  # 0.6, 0.36 >= 0.25; 0.22 not


def test_history_falls_with_rejections_and_recovers_with_acceptances():
    history = AcceptanceHistory()
    assert history.rate == 0.5
    for _ in range(5):
        history.record(4, 0)
    assert history.rate < 0.1
    for _ in range(10):
        history.record(4, 4)
    assert history.rate > 0.9


def test_a_failing_sequence_pauses_longer_each_time_and_retries_one_draft():
    history = AcceptanceHistory()
    for _ in range(4):
        history.record(4, 0)
    assert not worth_alone(DEAR_ROWS, 100, history.rate)
    pauses = []
    for _ in range(6):
        history.pause()
        steps = 0
        while not history.limit(4):
            steps += 1
        pauses.append(steps)
        assert history.limit(4) == 1 and history.plan_rate == 0.5  # a retry: one draft, the benefit of the doubt
        history.record(1, 0)
        assert history.limit(4) == 4 and history.plan_rate == history.rate < 0.1
    assert pauses == [FIRST_PAUSE, 8, LONGEST_PAUSE, LONGEST_PAUSE, LONGEST_PAUSE, LONGEST_PAUSE]
    history.record(1, 1)  # a retry that is accepted resets the pause
    history.pause()
    assert history.paused == FIRST_PAUSE


def test_a_dropped_first_draft_is_checked_against_the_sampled_token():
    history = AcceptanceHistory()
    for sampled in (7, 7, 7):
        history.shadow = 7
        history.check_shadow(sampled)
    assert history.rate > 0.7 and history.shadow is None
    history.check_shadow(8)  # no shadow: nothing learned
    assert history.rate > 0.7
    history.shadow = 7
    history.check_shadow(8)
    assert history.rate < 0.7


def test_skipped_steps_and_mean_k_are_reported():
    stats = SpecDecodeStats(4)
    metrics = EngineMetrics("m", "both")
    stats.planned(4, 6, False)
    stats.report(metrics)
    assert metrics.spec_decode_mean_k._value.get() == 1.5
    stats.planned(8, 0, True)
    stats.planned(8, 0, True)
    stats.report(metrics)
    assert metrics.spec_decode_num_skipped_steps._value.get() == 2
    assert metrics.spec_decode_mean_k._value.get() == 0.0
    assert stats.num_skipped_steps == 2
