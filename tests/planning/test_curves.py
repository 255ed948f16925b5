"""Knee and C_max detection on synthetic curves, curve files, service-model fits and point summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.bench.client import RequestRecord
from tandem.bench.summary import mean_in_flight, summarize_point
from tandem.planning.curves import CurvePoint, find_c_max, find_knee, littles_law_check, load_curve
from tandem.planning.service_model import ServiceModel, fitted_decode_rate, fitted_prefill_rate

CONCURRENCY = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]


def synthetic_curve(capacity=32, itl_base=0.02, itl_per_seq=0.0005, prompt=1000, prefill_tok_s=10_000):
    """A server whose throughput grows linearly up to `capacity` requests in flight and then saturates (the
    excess queues for admission, adding to TTFT)."""
    points = []
    for c in CONCURRENCY:
        batch = min(c, capacity)
        itl = itl_base + itl_per_seq * batch
        service = prompt / prefill_tok_s + 100 * itl
        queueing = service * (c - batch) / capacity
        points.append(CurvePoint(concurrency=c, e2e_mean_s=service + queueing, request_throughput=batch / service,
                                 ttft_p50_s=prompt / prefill_tok_s + queueing,
                                 ttft_p99_s=1.5 * (prompt / prefill_tok_s) + 1.2 * queueing,
                                 itl_p50_s=itl, itl_p99_s=1.3 * itl, mean_input_tokens=prompt))
    return points


def test_knee_of_a_saturating_throughput_curve():
    points = synthetic_curve(capacity=32)
    knee = find_knee([p.concurrency for p in points], [p.request_throughput for p in points])
    assert points[knee].concurrency == 32


def test_knee_of_a_smooth_curve_and_of_a_latency_curve():
    xs = [1, 2, 4, 8, 16, 32, 64, 128]
    smooth = [100 * x / (x + 16) for x in xs]  # Michaelis-Menten: half of the asymptote at 16
    assert xs[find_knee(xs, smooth)] in (16, 32)
    latency = [0.1] * 5 + [0.11, 1.5, 3.0]  # flat up to 32, then climbing steeply
    assert xs[find_knee(xs, latency, shape="convex")] == 32


def test_no_knee_on_a_straight_line_or_too_few_points():
    assert find_knee([1, 2, 3, 4], [2, 4, 6, 8]) is None
    assert find_knee([1, 2], [1, 5]) is None
    with pytest.raises(ValueError, match="x values but"):
        find_knee([1, 2, 3], [1, 2])


def test_c_max_is_the_highest_concurrency_meeting_both_slos():
    points = synthetic_curve(capacity=32)
    # ITL p99 = 1.3 x (0.02 + 0.0005 c): within 50 ms up to c = 36, so 32 passes and 48 fails on both counts.
    assert find_c_max(points, slo_ttft_s=0.5, slo_itl_s=0.05).concurrency == 32
    # Only TTFT: queueing (3.7 s of service x excess / 32) starts past 32; TTFT p99 = 0.15 + 1.2 x queueing is
    # 2.37 s at 48 and 4.59 s at 64.
    assert find_c_max(points, slo_ttft_s=2.5, slo_itl_s=None).concurrency == 48
    assert find_c_max(points, slo_ttft_s=0.01, slo_itl_s=None) is None
    with pytest.raises(ValueError, match="needs an SLO"):
        find_c_max(points, None, None)


def test_c_max_does_not_trust_a_pass_beyond_a_miss():
    def pt(c, ttft):
        return CurvePoint(concurrency=c, e2e_mean_s=1.0, ttft_p99_s=ttft, itl_p99_s=0.01)

    noisy = [pt(1, 0.1), pt(2, 0.2), pt(4, 0.9), pt(8, 0.4)]  # 8 passing again is noise after the miss at 4
    assert find_c_max(noisy, slo_ttft_s=0.5, slo_itl_s=0.05).concurrency == 2
    assert find_c_max(noisy, 0.5, 0.05, percentile="p99") is not None
    with pytest.raises(ValueError, match="no ttft p50"):
        find_c_max(noisy, 0.5, None, percentile="p50")


def test_littles_law_check():
    assert littles_law_check(32, 8.0, 4.0).ok
    check = littles_law_check(32, 2.0, 4.0)
    assert check.implied_concurrency == 8 and check.gap == 4 and not check.ok
    assert littles_law_check(10, 10.0, 1.9).ok  # 19 vs 10: within 2x
    assert not littles_law_check(10, 10.0, 2.1).ok  # 21 vs 10: more than 2x off
    assert littles_law_check(10, 10.0, 2.1, tolerance=3.0).ok
    assert littles_law_check(10, 0.0, 1.0).gap == float("inf")
    with pytest.raises(ValueError, match="tolerance"):
        littles_law_check(1, 1, 1, tolerance=0.5)


def test_load_curve_reads_bench_json_and_hand_made_yaml(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"conditions": {}, "points": [
        {"index": 1, "concurrency": 4, "summary": {"concurrency": 4, "e2e_mean_s": 2.0, "completed": 3,
                                                   "ttft_p99_s": 0.3, "errors": []}},
        {"index": 0, "concurrency": 1, "summary": {"concurrency": 1, "e2e_mean_s": 1.0, "completed": 3}},
        {"index": 2, "concurrency": 8, "summary": {"concurrency": 0, "e2e_mean_s": None, "completed": 0}},
        # Refused in part (429s come back in milliseconds): not the load it claims.
        {"index": 3, "concurrency": 16, "summary": {"concurrency": 16, "e2e_mean_s": 0.1, "completed": 2,
                                                    "failed": 30}},
    ]}))
    points = load_curve(bench)
    assert [p.concurrency for p in points] == [1, 4]  # sorted; the points with failed requests are left out
    assert points[1].ttft_p99_s == 0.3
    hand = tmp_path / "curve.yaml"
    hand.write_text("points:\n  - {concurrency: 2, e2e_mean_s: 0.5}\n")
    assert load_curve(hand)[0].usable_rps == 4
    hand.write_text("points:\n  - {e2e_mean_s: 0.5}\n")
    with pytest.raises(ValueError, match="lacks concurrency"):
        load_curve(hand)


def test_service_model_fit_recovers_a_linear_decode_step():
    points = synthetic_curve(capacity=128, itl_base=0.02, itl_per_seq=0.0005)
    model = ServiceModel.from_curve(points, slo_itl_s=0.05)
    assert model.itl_base_s == pytest.approx(0.02) and model.itl_per_seq_s == pytest.approx(0.0005)
    assert model.max_batch == 60  # 0.02 + 0.0005 x 60 = 50 ms
    assert model.prefill_tok_s == pytest.approx(10_000)
    assert fitted_prefill_rate(points) == pytest.approx(10_000)
    # Highest concurrency with ITL p99 = 1.3 x itl <= 50 ms is 32: 32 sequences / 36 ms.
    assert fitted_decode_rate(points, 0.05, "p99") == pytest.approx(32 / 0.036)


def test_service_model_from_rates_keeps_the_rates():
    model = ServiceModel.from_rates(prefill_tok_s=20_000, decode_tok_s=2_500, slo_itl_s=0.05)
    assert model.decode_tok_s() == pytest.approx(2_500, rel=0.01)
    assert model.itl(model.max_batch) == pytest.approx(0.04)  # a full batch runs at 80% of the ITL SLO
    assert model.prefill_time(2000) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="decode_tok_s must be > 0"):
        ServiceModel.from_rates(1.0, 0.0, 0.05)


def _record(start, ttft, gaps, warmup=False, ok=True, tokens=None):
    e2e = ttft + sum(gaps)
    n = tokens if tokens is not None else len(gaps) + 1
    return RequestRecord(point=0, index=0, warmup=warmup, input_tokens=10, output_tokens=n, start_s=start,
                         finished_s=start + e2e, ok=ok, ttft_s=ttft if ok else None, e2e_s=e2e if ok else None,
                         tpot_s=sum(gaps) / (n - 1) if ok and n > 1 else None, itl_s=list(gaps) if ok else [],
                         prompt_tokens=10 if ok else None, completion_tokens=n if ok else None,
                         error=None if ok else "HTTP 429: busy")


def test_point_summary_statistics_window_and_slo():
    records = [
        _record(0.0, 0.5, [0.1, 0.1], warmup=True),  # 0.0 .. 0.7, left out of the statistics
        _record(0.5, 0.2, [0.1, 0.1, 0.1]),  # 0.5 .. 1.0
        _record(1.0, 0.4, [0.3, 0.3]),  # 1.0 .. 2.0
        _record(1.5, 0.1, [], ok=False),  # failed at 1.6
    ]
    s = summarize_point(records, target_concurrency=2, rate=None, slo_ttft_s=0.3, slo_itl_s=0.2)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(1.5)  # first measured send 0.5 .. last end 2.0
    assert s["request_throughput"] == pytest.approx(2 / 1.5)
    assert s["output_throughput"] == pytest.approx((4 + 3) / 1.5)
    assert s["ttft_p50_s"] == pytest.approx(0.3) and s["ttft_mean_s"] == pytest.approx(0.3)
    assert s["itl_p50_s"] == pytest.approx(float(np.percentile([0.1, 0.1, 0.1, 0.3, 0.3], 50)))
    assert s["e2e_mean_s"] == pytest.approx((0.5 + 1.0) / 2)
    # Busy time in [0.5, 2.0]: warm-up 0.2 + 0.5 + 1.0 + failed 0.1 = 1.8 s over 1.5 s.
    assert s["mean_in_flight"] == pytest.approx(1.8 / 1.5)
    # Only the first measured request meets TTFT <= 0.3 and TPOT <= 0.2; the failed one counts as a miss.
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["errors"] == ["HTTP 429: busy"]
    assert s["concurrency"] == 2


def test_rate_sweep_points_use_the_measured_concurrency():
    records = [_record(0.0, 0.5, [0.5]), _record(0.0, 0.5, [0.5])]
    s = summarize_point(records, target_concurrency=None, rate=4.0)
    assert s["concurrency"] == pytest.approx(2.0) == mean_in_flight(records, (0.0, 1.0))
    assert s["slo_attainment"] is None


@pytest.mark.parametrize("field, value", [("ttft_p99_s", float("nan")), ("itl_p99_s", -5.0),
                                          ("request_throughput", float("inf"))])
def test_a_point_with_a_latency_that_is_no_measurement_is_refused(field, value):
    """NaN or a negative latency would pass every SLO test (value > target is False): the point is refused."""
    with pytest.raises(ValueError, match=f"{field} must be a finite number >= 0"):
        CurvePoint(concurrency=4, e2e_mean_s=1.0, **{field: value})


def test_usable_rps_is_the_throughput_measured_at_the_point_when_it_has_one():
    """Found by a new user: bench and plan said 3.03 requests/s were usable at C_max (C_max / E2E) where the same
    sweep measured 2.62 at that concurrency. The measured throughput is what the instance sustained."""
    from tandem.planning.curves import CurvePoint

    measured = CurvePoint(concurrency=8, e2e_mean_s=2.64, request_throughput=2.62)
    assert measured.usable_rps == 2.62 and "measured" in measured.usable_rps_basis
    hand_made = CurvePoint(concurrency=8, e2e_mean_s=2.0)
    assert hand_made.usable_rps == 4.0 and hand_made.usable_rps_basis == "C_max / E2E = 8 / 2.000 s"
