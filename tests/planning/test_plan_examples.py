"""`tandem plan` reproduces the field guide's worked examples, and its patch is a valid LLMDeployment change."""

from __future__ import annotations

import json

import pytest
import yaml

from tandem.cli import main
from tandem.operator.crd import LLMDeploymentSpec
from tandem.planning.curves import CurvePoint, find_c_max
from tandem.planning.profile import WorkloadProfile
from tandem.planning.report import format_plan, plan_patch
from tandem.planning.sizing import (
    ceil_count,
    disaggregation_threshold,
    gpus_needed,
    instances_needed,
    make_plan,
    phase_loads,
    queue_limit,
    reduce_ratio,
    split_total,
    usable_rps,
)

# One instance measured at five concurrencies: the SLO (p99 TTFT <= 2 s, p99 ITL <= 50 ms) holds up to 48,
# where the mean E2E latency is 4 s; at 64 both percentiles break.
GUIDE_CURVE = [
    {"concurrency": 8, "e2e_mean_s": 2.0, "request_throughput": 4.0, "ttft_p50_s": 0.3, "ttft_p99_s": 0.5,
     "itl_p50_s": 0.020, "itl_p99_s": 0.025},
    {"concurrency": 16, "e2e_mean_s": 2.4, "request_throughput": 6.67, "ttft_p50_s": 0.4, "ttft_p99_s": 0.7,
     "itl_p50_s": 0.024, "itl_p99_s": 0.030},
    {"concurrency": 32, "e2e_mean_s": 3.2, "request_throughput": 10.0, "ttft_p50_s": 0.6, "ttft_p99_s": 1.1,
     "itl_p50_s": 0.030, "itl_p99_s": 0.040},
    {"concurrency": 48, "e2e_mean_s": 4.0, "request_throughput": 12.0, "ttft_p50_s": 0.9, "ttft_p99_s": 1.8,
     "itl_p50_s": 0.036, "itl_p99_s": 0.048},
    {"concurrency": 64, "e2e_mean_s": 5.6, "request_throughput": 11.4, "ttft_p50_s": 1.6, "ttft_p99_s": 3.5,
     "itl_p50_s": 0.045, "itl_p99_s": 0.070},
]


@pytest.fixture
def guide_curve_file(tmp_path):
    path = tmp_path / "curve.yaml"
    path.write_text(yaml.safe_dump({"points": GUIDE_CURVE}))
    return path


def test_guide_example_fleet_size_from_c_max():
    point = find_c_max([CurvePoint.from_summary(p) for p in GUIDE_CURVE], slo_ttft_s=2.0, slo_itl_s=0.05)
    assert point.concurrency == 48
    assert usable_rps(48, point.e2e_mean_s) == 12
    assert instances_needed(120, 12) == 10
    assert gpus_needed(10, 4, 1.3) == 52  # 10 x 4 x 1.3 is 52.000000000000007 in binary floating point


def test_ceilings_ignore_float_dust_but_not_real_excess():
    assert ceil_count(10 * 4 * 1.3) == 52
    assert ceil_count(52.001) == 53
    assert instances_needed(120.5, 12) == 11


def test_guide_example_queue_limit():
    assert queue_limit(2.0, 50.0) == 100
    assert queue_limit(0.5, 3.0) == 2  # 1.5 requests of arrivals: room for 2


def test_pd_ratio_from_stated_rates():
    # 10 RPS x 2,000 input tokens / 20,000 tok/s = 1 prefill worker; 10 x 250 / 2,500 = 1 decode worker.
    loads = phase_loads(10, 2000, 250, prefill_tok_s=20_000, decode_tok_s=2_500)
    assert (loads.prefill, loads.decode, loads.ratio_text) == (1.0, 1.0, "1:1")
    # 1.5 : 2.0 workers is 3:4; a lopsided load keeps its small-integer shape.
    assert phase_loads(10, 3000, 500, 20_000, 2_500).ratio == (3, 4)
    assert phase_loads(10, 500, 500, 20_000, 2_500).ratio == (1, 8)


def test_reduce_ratio_picks_the_smallest_closest_pair():
    assert reduce_ratio(2.0, 2.0) == (1, 1)
    assert reduce_ratio(1.0, 3.0) == (1, 3)
    assert reduce_ratio(0.37, 1.0, max_term=8) == (3, 8)
    assert reduce_ratio(1.0, 100.0, max_term=8) == (1, 8)  # clamped to the largest allowed term
    with pytest.raises(ValueError, match="prefill share"):
        reduce_ratio(0.0, 1.0)


def test_disaggregation_threshold_formula():
    # (50 ms ITL SLO - 30 ms decode step) x 20,000 prompt tokens/s = 400 tokens.
    assert disaggregation_threshold(0.05, 0.03, 20_000) == 400
    assert disaggregation_threshold(0.05, 0.06, 20_000) == 0  # no ITL room left: disaggregate everything


def test_split_total_matches_the_operators_ratio_split():
    from tandem.operator.sizing import split_by_ratio

    for total in range(2, 40):
        for ratio in ((1, 1), (1, 3), (3, 4), (5, 2)):
            got = split_total(total, ratio)
            want = split_by_ratio(total, f"{ratio[0]}:{ratio[1]}")
            assert got == (want.prefill, want.decode), (total, ratio)


def test_make_plan_reproduces_the_guide_and_the_ratio():
    profile = WorkloadProfile(peak_rps=120, input_tokens="2000", output_tokens="250", slo_ttft=2.0, slo_itl=0.05,
                              tensor_parallel_size=4, safety_factor=1.3, max_queue_wait=2.0, queue_arrival_rps=50,
                              prefill_tok_s=20_000, decode_tok_s=2_500)
    plan = make_plan(profile, [CurvePoint.from_summary(p) for p in GUIDE_CURVE])
    assert (plan.c_max.concurrency, plan.usable_rps, plan.instances, plan.gpus) == (48, 12, 10, 52)
    assert plan.queue_limit == 100
    assert plan.knee_concurrency == 32  # throughput stops paying past 32 (12 RPS at 48, less at 64)
    # 120 RPS: 120 x 2000 / 20000 = 12 prefill workers, 120 x 250 / 2500 = 12 decode workers -> 1:1.
    assert plan.loads.ratio_text == "1:1"
    assert (plan.prefill_replicas, plan.decode_replicas) == (16, 16)  # ceil(12 x 1.3)
    # The decode step defaults to the curve's P50 ITL at C_max: (0.05 - 0.036) x 20000 = 280 tokens.
    assert plan.disagg_threshold == 280
    assert plan.little_ok
    table = format_plan(plan)
    for text in ("C_max (per instance)", "ceil(120 / 12.00)", "ceil(10 x TP4 x 1.3)", "1:1",
                 "ceil(2 s max wait x 50 RPS)", "p99 TTFT <= 2.000 s and p99 ITL <= 0.050 s"):
        assert text in table
    # A target not given is not shown as "<= n/a"; none given is said so.
    assert "SLO       p99 TTFT <= 2.000 s; TP4" in format_plan(make_plan(profile.model_copy(update={"slo_itl": None})))
    no_slo = format_plan(make_plan(profile.model_copy(update={"slo_itl": None, "slo_ttft": None})))
    assert "n/a s" not in no_slo and "<= n/a" not in no_slo and "SLO       no SLO given;" in no_slo


def test_patch_is_a_valid_llmdeployment_change():
    profile = WorkloadProfile(peak_rps=10, input_tokens=3000, output_tokens=500, slo_itl=0.05, decode_step_s=0.03,
                              prefill_tok_s=20_000, decode_tok_s=2_500, safety_factor=1.0)
    plan = make_plan(profile)
    base = {"model": {"name": "m", "format": "gguf", "source": {"uri": "smollm2"}}, "image": "tandem:dev",
            "ratio": "1:1", "replicas": 2}

    def merge(target, patch):  # RFC 7386 JSON merge patch, as `kubectl patch --type merge` applies it
        out = dict(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif isinstance(value, dict):
                out[key] = merge(out.get(key) or {}, value)
            else:
                out[key] = value
        return out

    pools = LLMDeploymentSpec.model_validate(merge(base, plan_patch(plan, "pools")["spec"]))
    assert (pools.prefill.replicas, pools.decode.replicas, pools.ratio) == (2, 2, None)
    assert pools.router.disagg_min_tokens == 400
    by_ratio = LLMDeploymentSpec.model_validate(merge(base, plan_patch(plan, "ratio")["spec"]))
    assert (by_ratio.ratio, by_ratio.replicas) == ("3:4", 4)
    with pytest.raises(ValueError, match="patch style"):
        plan_patch(plan, "sideways")


def test_plan_counts_gpus_as_replicas_times_each_pools_tensor_parallel_size():
    profile = WorkloadProfile(peak_rps=10, input_tokens=3000, output_tokens=500, slo_itl=0.05, decode_step_s=0.03,
                              prefill_tok_s=20_000, decode_tok_s=2_500, safety_factor=1.0, tensor_parallel_size=2)
    same = make_plan(profile)
    assert (same.prefill_replicas, same.decode_replicas, same.pd_gpus) == (2, 2, 8)
    assert "(2 + 2) x TP2" in format_plan(same)
    assert "tensorParallelSize" not in plan_patch(same)["spec"]["decode"]

    mixed = make_plan(profile.model_copy(update={"prefill_tensor_parallel_size": 1, "decode_tensor_parallel_size": 4}))
    assert (mixed.prefill_replicas, mixed.decode_replicas, mixed.pd_gpus) == (2, 2, 2 * 1 + 2 * 4)
    table = format_plan(mixed)
    assert "2 x TP1 + 2 x TP4" in table and "TP2 (prefill TP1, decode TP4)" in table
    patch = plan_patch(mixed)["spec"]
    assert (patch["prefill"], patch["decode"]) == ({"replicas": 2, "tensorParallelSize": 1},
                                                   {"replicas": 2, "tensorParallelSize": 4})
    assert plan_patch(mixed, "ratio")["spec"]["decode"] == {"replicas": None, "tensorParallelSize": 4}
    assert LLMDeploymentSpec.model_validate(
        {"model": {"name": "m", "format": "gguf", "source": {"uri": "smollm2"}}, "image": "tandem:dev",
         **patch, "ratio": None, "replicas": None}).decode.tensor_parallel_size == 4


def test_cli_plan_prints_the_guide_numbers_and_a_patch(guide_curve_file, capsys):
    rc = main(["plan", "--curve", str(guide_curve_file), "--peak-rps", "120", "--slo-ttft", "2", "--slo-itl",
               "0.05", "--tensor-parallel-size", "4", "--safety-factor", "1.3", "--max-queue-wait", "2",
               "--queue-arrival-rps", "50", "--prefill-tok-s", "20000", "--decode-tok-s", "2500",
               "--input-tokens", "2000", "--output-tokens", "250", "--format", "json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["c_max"], doc["usable_rps_per_instance"], doc["instances"], doc["gpus"]) == (48, 12, 10, 52)
    assert doc["queue_limit"] == 100 and doc["ratio"] == "1:1"
    assert doc["patch"]["spec"]["prefill"] == {"replicas": 16}


def test_cli_profile_file_with_flag_override(tmp_path, capsys):
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({"peak_rps": 10, "input_tokens": 2000, "output_tokens": "fixed:250",
                                       "prefill_tok_s": 20000, "decode_tok_s": 2500, "slo_ttft": 2.0,
                                       "safety_factor": 1.0}))
    patch = tmp_path / "patch.yaml"
    rc = main(["plan", "--profile", str(profile), "--peak-rps", "20", "--patch-out", str(patch)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "peak 20 RPS" in out and "1:1" in out
    assert "ceil(2 s max wait x 20 RPS)" in out  # the wait defaults to the TTFT SLO
    assert yaml.safe_load(patch.read_text())["spec"]["decode"] == {"replicas": 2}


def test_cli_plan_errors_are_clear(tmp_path, capsys):
    assert main(["plan", "--prefill-tok-s", "1000", "--decode-tok-s", "100"]) == 2
    assert "peak request rate" in capsys.readouterr().err
    assert main(["plan", "--peak-rps", "5"]) == 2
    assert "measured curve" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("peak_rps: 5\nbogus: 1\n")
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(bad)])
    assert "unknown fields bogus" in capsys.readouterr().err


def test_littles_law_gap_is_flagged(tmp_path):
    # Claims 32 in flight, but 2 RPS x 4 s = 8: the client never ran 32 concurrent requests.
    curve = [dict(GUIDE_CURVE[0]), {**GUIDE_CURVE[2], "request_throughput": 2.0, "e2e_mean_s": 4.0}]
    plan = make_plan(WorkloadProfile(peak_rps=10, slo_ttft=2.0, slo_itl=0.05, prefill_tok_s=1e4, decode_tok_s=1e3),
                     [CurvePoint.from_summary(p) for p in curve])
    assert not plan.little_ok
    assert any("Little's law gap at concurrency 32" in n and "4.0x off" in n for n in plan.notes)
    assert "FAILED" in format_plan(plan)


@pytest.mark.parametrize("profile_args, slo_ttft, reason", [
    ({}, 0.1, "no curve point meets the SLO to read a decode step time from: give --decode-step-s"),
    ({"slo_itl": None}, 2.0, "needs --slo-itl"),
])
def test_a_missing_disaggregation_threshold_says_what_it_lacks(profile_args, slo_ttft, reason):
    # A TTFT SLO of 0.1 s that no point meets: the curve was given, but has no C_max to read the ITL at.
    profile = WorkloadProfile(**{"peak_rps": 10, "slo_ttft": slo_ttft, "slo_itl": 0.05, "prefill_tok_s": 1e4,
                                 "decode_tok_s": 1e3, **profile_args})
    plan = make_plan(profile, [CurvePoint.from_summary(p) for p in GUIDE_CURVE])
    assert plan.disagg_threshold is None
    row = next(line for line in format_plan(plan).splitlines() if "disaggregation threshold" in line)
    assert "n/a" in row and reason in row


def test_pools_split_from_the_curves_gpus_cover_their_own_loads():
    """Workers sized from the colocated curve (GPUs / TP) are split at the reduced P:D ratio, rounded: a pool could
    land under the load the plan itself prints. The total is raised until both pools cover theirs."""
    # The guide's curve, with the lengths it was measured at: the per-phase rates are fitted from it.
    curve = [CurvePoint.from_summary({**p, "mean_input_tokens": 2000, "mean_output_tokens": 250}) for p in GUIDE_CURVE]
    raised = 0
    for rps in [x / 4 for x in range(4, 400, 3)]:
        for tokens in (("2000", "250"), ("512", "128"), ("5000", "1000")):
            profile = WorkloadProfile(peak_rps=rps, input_tokens=tokens[0], output_tokens=tokens[1], slo_ttft=2.0,
                                      slo_itl=0.05, ratio_max_term=1)
            plan = make_plan(profile, curve)
            if plan.loads is None:  # no split: the curve has no C_max at this SLO to fit rates at
                continue
            assert plan.prefill_replicas >= plan.loads.prefill and plan.decode_replicas >= plan.loads.decode, (
                rps, tokens, plan.loads, plan.prefill_replicas, plan.decode_replicas)
            raised += "raised to" in plan.replicas_source
    assert raised  # the sweep met the case


def test_a_ratio_patch_that_would_not_give_the_plans_pools_is_refused():
    """Pools of 7 prefill + 2 decode reduce to 5:1 (at most 8 per term); the operator splits 9 workers at 5:1 into 8 + 1,
    one decode worker under a load of 1.01: the ratio style cannot say this plan, the pools style can."""
    plan = make_plan(WorkloadProfile(peak_rps=1, input_tokens="5000", output_tokens="1010", prefill_tok_s=1000,
                                     decode_tok_s=1000))
    assert (plan.prefill_replicas, plan.decode_replicas) == (7, 2)
    with pytest.raises(ValueError, match="splits 9 workers at 5:1 into 8 prefill \\+ 1 decode.*--patch-style pools"):
        plan_patch(plan, "ratio")
    assert plan_patch(plan, "pools")["spec"]["decode"] == {"replicas": 2}


def test_cli_plan_says_why_it_cannot_write_the_patch(capsys):
    rc = main(["plan", "--peak-rps", "10", "--prefill-tok-s", "1000", "--decode-tok-s", "1000", "--patch-out",
               "/nonexistent-dir/patch.yaml"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("tandem plan: error: cannot write the patch to "
                                               "/nonexistent-dir/patch.yaml: No such file or directory")
