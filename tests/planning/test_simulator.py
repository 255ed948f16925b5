"""The fleet simulator: exact service times on tiny traces, and static vs planner on a short diurnal trace."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.bench.distributions import parse_distribution
from tandem.planning.policy import PlannerLimits
from tandem.planning.service_model import ServiceModel
from tandem.planning.simulator import PlannerPolicy, SimConfig, StaticPolicy, format_comparison, simulate
from tandem.planning.sizing import pool_replicas
from tandem.planning.workload import DiurnalRate, Trace, poisson_trace

MODEL = ServiceModel(prefill_tok_s=1000.0, itl_base_s=0.01, itl_per_seq_s=0.005, max_batch=2)


def tiny(arrivals, inputs, outputs) -> Trace:
    return Trace(np.array(arrivals, dtype=float), np.array(inputs), np.array(outputs))


def test_one_request_gets_prefill_then_decode_time():
    config = SimConfig(MODEL, slo_ttft_s=1.0, slo_itl_s=0.1, tick_s=1.0)
    result = simulate(tiny([0.0], [500], [11]), config, StaticPolicy(1, 1))
    assert result.ttft_p50_s == pytest.approx(0.5)  # 500 tokens at 1000 tok/s
    assert result.tpot_p50_s == pytest.approx(MODEL.itl(1))  # 10 decode steps alone in the batch
    assert result.attainment == 1.0


def test_decode_batch_mates_slow_each_other_down():
    # Two prompts at t=0 on one prefill worker: first tokens at 0.1 s and 0.2 s. Request 0 decodes alone at
    # itl(1) = 15 ms from 0.1 to 0.2 s (6.67 tokens), then both share steps of itl(2) = 20 ms.
    config = SimConfig(MODEL, slo_ttft_s=1.0, slo_itl_s=1.0, tick_s=1.0)
    sim_result = simulate(tiny([0.0, 0.0], [100, 100], [21, 11]), config, StaticPolicy(1, 1))
    alone = 0.1 / MODEL.itl(1)
    # Request 1 needs 10 tokens at itl(2) = 0.2 s; meanwhile request 0 makes 10 more, leaving 20 - alone - 10
    # to make alone again at itl(1).
    t1_finish = 0.2 + 10 * MODEL.itl(2)
    t0_finish = t1_finish + (20 - alone - 10) * MODEL.itl(1)
    expected_tpot = sorted([(t0_finish - 0.1) / 20, (t1_finish - 0.2) / 10])
    assert sim_result.tpot_p50_s == pytest.approx(np.percentile(expected_tpot, 50))
    assert sim_result.ttft_p99_s == pytest.approx(np.percentile([0.1, 0.2], 99))


def test_a_full_decode_batch_queues_the_next_request():
    one_slot = ServiceModel(prefill_tok_s=1e6, itl_base_s=0.01, itl_per_seq_s=0.0, max_batch=1)
    config = SimConfig(one_slot, slo_ttft_s=1.0, slo_itl_s=0.0101, tick_s=1.0)
    # Both prefill at once (2 workers); the second waits for the first's 10 decode steps (0.1 s).
    result = simulate(tiny([0.0, 0.0], [1, 1], [11, 11]), config, StaticPolicy(2, 1))
    assert result.attainment == 0.5  # the queued one's mean inter-token time doubles
    assert result.tpot_p99_s == pytest.approx(np.percentile([0.01, 0.02], 99), rel=1e-3)


@pytest.fixture(scope="module")
def diurnal():
    """A compressed day (2 h period, 10..40 RPS) of 2,000-in / 200-out requests."""
    model = ServiceModel.from_rates(prefill_tok_s=20_000, decode_tok_s=2_000, slo_itl_s=0.05)
    inp, out = parse_distribution("lognormal:2000:0.5", "input"), parse_distribution("lognormal:200:0.5", "output")
    rate = DiurnalRate(peak_rps=40.0, trough=0.25, low_at_s=0.0, period_s=7200.0)
    trace = poisson_trace(rate, 7200.0, inp, out, np.random.default_rng(11))
    config = SimConfig(model, slo_ttft_s=1.5, slo_itl_s=0.05, prefill_gpus_per_replica=4, decode_gpus_per_replica=4,
                       startup_s=60.0, tick_s=30.0)

    def sizing(rps):
        return (pool_replicas(rps * inp.mean / model.prefill_tok_s, 1.3),
                pool_replicas(rps * out.mean / model.decode_tok_s(), 1.3))

    limits = PlannerLimits(prefill_gpus_per_replica=4, decode_gpus_per_replica=4, target_utilization=1 / 1.3,
                           hysteresis=0.15, scale_up_cooldown_s=60.0, scale_down_cooldown_s=300.0)
    static = simulate(trace, config, StaticPolicy(*sizing(40.0)))
    planner = simulate(trace, config, PlannerPolicy(limits, sizing(float(rate(0.0)))))
    return trace, static, planner


def test_planner_saves_gpu_hours_at_comparable_attainment(diurnal):
    trace, static, planner = diurnal
    assert static.requests == planner.requests == len(trace) > 100_000
    assert static.attainment > 0.99
    assert planner.attainment >= static.attainment - 0.01
    assert planner.gpu_hours < 0.8 * static.gpu_hours
    assert static.scale_changes == 0 and planner.scale_changes > 4
    # The planner follows the day: fewest replicas near the trough (start and end), most near the peak.
    decode = [d for _, _, d in planner.timeline]
    assert max(decode) > decode[0] and max(decode) > decode[-1]
    table = format_comparison([static, planner], 1.5, 0.05)
    assert "static" in table and "planner" in table and "GPU-hours" in table


def test_planner_respects_a_gpu_budget(diurnal):
    trace, _, _ = diurnal
    model = ServiceModel.from_rates(prefill_tok_s=20_000, decode_tok_s=2_000, slo_itl_s=0.05)
    config = SimConfig(model, slo_ttft_s=1.5, slo_itl_s=0.05, prefill_gpus_per_replica=4, decode_gpus_per_replica=4,
                       startup_s=60.0, tick_s=30.0)
    limits = PlannerLimits(prefill_gpus_per_replica=4, decode_gpus_per_replica=4, gpu_budget=24,
                           scale_up_cooldown_s=60.0, scale_down_cooldown_s=300.0)
    result = simulate(trace, config, PlannerPolicy(limits, (1, 1)))
    # Draining workers still hold GPUs until their last request ends, so the live pools stay under budget.
    assert all((p + d) * 4 <= 24 for _, p, d in result.timeline)


def test_planner_sim_benchmark_script_runs(capsys, monkeypatch):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_sim.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--hours", "0.5", "--period-hours", "0.5", "--peak-rps", "4",
                                      "--tick-s", "30", "--startup-s", "30"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "planner / static GPU-hours:" in out and "static" in out and "SLO attained" in out
