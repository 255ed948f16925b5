"""Per-point summaries: throughput, latency percentiles, in-flight concurrency and SLO attainment.

Only measured requests count (warm-up requests are sent but left out). The measurement window runs from
the first measured request's send to the last one's end; throughputs are over that window. `mean_in_flight`
is the time-averaged number of requests of ANY kind (warm-up and failed ones too) in flight during the
window: the concurrency the server really saw. A request meets the SLO when its TTFT and its mean time per
output token (TPOT) are within the targets; a failed request misses it.
"""

from __future__ import annotations

import numpy as np

from tandem.bench.client import RequestRecord

STATS = ("mean", "p50", "p90", "p99")


def _stats(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_{s}_s": None for s in STATS}
    arr = np.asarray(values, dtype=float)
    return {f"{name}_mean_s": float(arr.mean()), f"{name}_p50_s": float(np.percentile(arr, 50)),
            f"{name}_p90_s": float(np.percentile(arr, 90)), f"{name}_p99_s": float(np.percentile(arr, 99))}


def mean_in_flight(records: list[RequestRecord], window: tuple[float, float]) -> float:
    """Time-averaged count of requests in flight during `window` (seconds from the point's start)."""
    w0, w1 = window
    if w1 <= w0:
        return 0.0
    busy = sum(max(0.0, min(r.finished_s, w1) - max(r.start_s, w0)) for r in records if r.finished_s is not None)
    return busy / (w1 - w0)


def summarize_point(records: list[RequestRecord], target_concurrency: int | None, rate: float | None,
                    slo_ttft_s: float | None = None, slo_itl_s: float | None = None) -> dict:
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    ended = [r for r in measured if r.finished_s is not None]
    window = (min(r.start_s for r in measured), max(r.finished_s for r in ended)) if ended else (0.0, 0.0)
    duration = window[1] - window[0]
    in_flight = mean_in_flight(records, window)
    prompt = [r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens for r in done]
    completion = [r.completion_tokens or 0 for r in done]
    summary = {
        "concurrency": target_concurrency if target_concurrency is not None else in_flight,
        "target_concurrency": target_concurrency,
        "rate": rate,
        "requests": len(measured),
        "completed": len(done),
        "failed": len(measured) - len(done),
        "duration_s": duration,
        "mean_in_flight": in_flight,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "input_throughput": sum(prompt) / duration if duration > 0 else None,
        "output_throughput": sum(completion) / duration if duration > 0 else None,
        "mean_input_tokens": float(np.mean(prompt)) if done else None,
        "mean_output_tokens": float(np.mean(completion)) if done else None,
    }
    summary.update(_stats("ttft", [r.ttft_s for r in done]))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl_s]))
    summary.update(_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None]))
    summary.update(_stats("e2e", [r.e2e_s for r in done]))
    if slo_ttft_s is not None or slo_itl_s is not None:
        good = sum(1 for r in done
                   if (slo_ttft_s is None or r.ttft_s <= slo_ttft_s)
                   and (slo_itl_s is None or r.tpot_s is None or r.tpot_s <= slo_itl_s))
        summary["slo_attainment"] = good / len(measured) if measured else None
        summary["goodput_rps"] = good / duration if duration > 0 else None
    else:
        summary["slo_attainment"] = summary["goodput_rps"] = None
    errors = sorted({r.error for r in measured if r.error})
    summary["errors"] = errors[:5]
    return summary
