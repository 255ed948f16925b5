"""The step cost model: its predictions, and the fit the worker keeps of it."""

import math

import pytest

from tandem.step_cost import StepCost, StepCostFit, attention_pairs

COST = StepCost(base_s=0.01, token_s=0.001, sequence_s=0.0005, pair_s=1e-6, decode_base_s=0.01,
                decode_sequence_s=0.0015, decode_pair_s=1e-6)


def test_attention_pairs_count_causal_query_key_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 3) == 11 + 12 + 13
    assert attention_pairs(100, 1) == 101  # a decode step reads its whole context


def test_a_prefill_is_chunked_by_the_budget_and_shares_its_steps_with_running_decodes():
    # 1,000 tokens in one step: base + tokens + one sample + 500,500 pairs.
    assert COST.prefill_s(1000) == pytest.approx(0.01 + 1.0 + 0.0005 + 0.5005)
    # A budget of 400 leaves three chunks: three bases.
    assert COST.prefill_s(1000, budget=400) == pytest.approx(COST.prefill_s(1000) + 2 * 0.01)
    # 100 decodes beside it take 100 tokens of each step's budget (1000 / 300: four chunks), and each of those
    # steps carries their decode: 100 tokens, 100 samples and their 20,000 context tokens.
    decode = COST.decode_step_s(100, 20_000)
    assert decode == pytest.approx(0.01 + 0.15 + 0.02)
    assert COST.prefill_s(1000, budget=400, decodes=100, decode_context_tokens=20_000) == pytest.approx(
        4 * decode + 1.0 + 0.0005 + 0.5005)  # each chunk's step: one base, its decodes, its share of the prompt
    # A cached prefix costs no tokens, only what the new tokens' attention reads of it.
    assert COST.prefill_s(100, cached_tokens=900) == pytest.approx(0.01 + 0.1 + 0.0005 + 1e-6 * attention_pairs(900, 100))
    assert COST.prefill_s(0) == 0.0


def test_long_prompts_cost_more_per_token_than_short_ones():
    per_token = [COST.prefill_s(n) / n for n in (100, 1000, 4000)]
    assert per_token[0] < per_token[1] < per_token[2]


def test_the_largest_batch_within_a_step_time():
    per_sequence = 0.0015 + 1e-6 * 500
    assert COST.largest_batch_within(0.1, 500, limit=1000) == int((0.1 - 0.01) / per_sequence)  # 45
    assert COST.largest_batch_within(0.1, 500, limit=8) == 8
    assert COST.largest_batch_within(0.011, 500, limit=64) == 0  # not even one sequence fits
    assert COST.decode_step_s(45, 45 * 500) <= 0.1 < COST.decode_step_s(46, 46 * 500)


def test_a_model_is_read_back_from_its_dict_and_bad_ones_are_refused():
    assert StepCost.from_dict(COST.to_dict()) == COST
    with pytest.raises(ValueError, match="pair_s"):
        StepCost.from_dict({"base_s": 1, "token_s": 1, "sequence_s": 1})
    with pytest.raises(ValueError, match="finite"):
        StepCost.from_dict({**COST.to_dict(), "token_s": -1})
    with pytest.raises(ValueError, match="object"):
        StepCost.from_dict([1, 2, 3, 4])


def synthetic_steps(cost: StepCost) -> list[tuple[int, int, int, float]]:
    """Prefills (one prompt, and eight of 64 tokens) and decode batches of several sizes, timed exactly by `cost`."""
    prefills = [(n, 1, attention_pairs(0, n)) for n in (16, 128, 512, 2048)] + [(512, 8, 8 * attention_pairs(0, 64))]
    decodes = [(b, b, b * context) for b, context in ((1, 100), (8, 300), (32, 150), (64, 500))]
    return [(t, s, p, cost.step_s(t, s, p)) for t, s, p in prefills] + \
        [(b, b, p, cost.decode_step_s(b, p)) for b, _, p in decodes]


def test_the_fit_recovers_the_model_that_timed_the_steps():
    fit = StepCostFit()
    assert fit.cost() is None
    steps = synthetic_steps(COST)
    for tokens, sequences, pairs, seconds in steps[:5]:
        fit.add(tokens, sequences, pairs, seconds, prior=True)
    assert fit.cost() is None  # no decode step yet: no decode model
    for tokens, sequences, pairs, seconds in steps[5:]:
        fit.add(tokens, sequences, pairs, seconds, prior=True)
    fitted = fit.cost()
    for name, value in COST.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name


def test_no_coefficient_is_fitted_below_zero():
    """Prefill steps whose time falls with their sequences (an unconstrained fit would make sequence_s negative) give
    sequence_s 0 and a model that still predicts them as well as it can."""
    fit = StepCostFit()
    for tokens, sequences, seconds in [(10, 1, 0.12), (12, 10, 0.11), (100, 1, 1.02), (120, 100, 1.0)]:
        fit.add(tokens, sequences, 0, seconds, prior=True)
    fit.add(1, 1, 10, 0.01, prior=True)
    cost = fit.cost()
    assert all(value >= 0 for value in cost.to_dict().values())
    assert cost.sequence_s == 0
    for tokens, sequences, seconds in [(10, 1, 0.12), (12, 10, 0.11), (100, 1, 1.02), (120, 100, 1.0)]:
        assert cost.step_s(tokens, sequences, 0) == pytest.approx(seconds, rel=0.15)


def test_measured_steps_move_the_fit_away_from_its_prior_and_the_newest_weigh_most():
    now = [0.0]
    fit = StepCostFit(half_life_s=60.0, clock=lambda: now[0])
    for step in synthetic_steps(COST):
        fit.add(*step, prior=True)
    slower = StepCost(**{k: 2 * v for k, v in COST.to_dict().items()})
    for _ in range(50):  # the machine is now twice as slow, for many half-lives of steps (11 s a round)
        for step in synthetic_steps(slower):
            fit.add(*step)
    # The prior (one round's worth) keeps a share against the half-life's worth (about five rounds) of new steps.
    moved = fit.cost().prefill_s(1000) / COST.prefill_s(1000)
    assert 1.7 < moved < 2.0
    for _ in range(50):  # and back to normal: the slow steps have decayed away
        for step in synthetic_steps(COST):
            fit.add(*step)
    assert fit.cost().prefill_s(1000) / COST.prefill_s(1000) == pytest.approx(moved)  # solved at most every 0.5 s
    now[0] += fit.REFRESH_S
    assert fit.cost().prefill_s(1000) / COST.prefill_s(1000) < 1.1


def test_steps_without_time_are_ignored():
    fit = StepCostFit()
    fit.add(10, 1, 10, 0.0)
    fit.add(10, 1, 10, math.nan)
    assert fit.cost() is None


def test_the_step_tail_is_the_99th_percentile_of_gaps_over_their_prediction():
    from tandem.step_cost import StepTail

    tail = StepTail(window=100)
    assert tail.factor == 1.0
    for i in range(100):
        tail.add(0.01 * (3.0 if i == 7 else 1.0 if i % 10 else 1.5), 0.01)  # one gap at 3x, nine at 1.5x
    assert tail.factor == 3.0
    for _ in range(100):  # the window moves on: the long gaps are forgotten
        tail.add(0.008, 0.01)
    assert tail.factor == 1.0  # never below the prediction


def test_an_engine_measures_decode_gaps_against_its_decode_model(tiny_llama_dir):
    """A review's find: the gaps between decode steps were measured against the prefill model, several times longer
    than a decode step, so the tail stayed at 1 however long the gaps ran."""
    from tandem.config import EngineConfig
    from tandem.workers.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model=tiny_llama_dir, num_kv_blocks=16))
    cost = StepCost(base_s=0.1, token_s=0.0, sequence_s=0.0, pair_s=0.0, decode_base_s=0.01, decode_sequence_s=0.0,
                    decode_pair_s=0.0)
    engine.step_costs = type("Fixed", (), {"cost": staticmethod(lambda: cost)})()
    engine.scheduler.running.append(object())  # a sequence waits on the next step
    for i in range(10):
        engine._time_gap(4, 4, 40, ended=i * 0.02)  # decode steps 20 ms apart: twice the decode model's 10 ms
    assert engine.step_tail.factor == pytest.approx(2.0)
