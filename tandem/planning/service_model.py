"""Service-time models of one prefill worker and one decode worker, fitted from measured curves or rates.

The planner and the simulator both need to know how fast a worker serves:
  prefill   a prompt of L tokens takes `prefill_overhead_s + L / prefill_tok_s` (prefill is compute-bound:
            its throughput in tokens/s is about flat once a batch fills the GPU);
  decode    one step of a batch of b sequences takes `itl(b) = itl_base_s + itl_per_seq_s * b` (decode is
            memory-bound: every step reads all weights, the fixed part, plus each sequence's KV, the part
            growing with b); each sequence gains one token per step, so the worker makes b / itl(b) tokens/s.
            At most `max_batch` sequences run at once, the batch at which itl reaches the ITL target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tandem.planning.curves import CurvePoint, Percentile, find_c_max


@dataclass(frozen=True)
class ServiceModel:
    prefill_tok_s: float
    itl_base_s: float
    itl_per_seq_s: float
    max_batch: int
    prefill_overhead_s: float = 0.0

    def __post_init__(self):
        for name in ("prefill_tok_s", "itl_base_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"service model: {name} must be > 0, got {value}")
        for name in ("itl_per_seq_s", "prefill_overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"service model: {name} must be >= 0, got {value}")
        if self.max_batch < 1:
            raise ValueError(f"service model: max_batch must be at least 1, got {self.max_batch}")

    def prefill_time(self, tokens: float) -> float:
        return self.prefill_overhead_s + tokens / self.prefill_tok_s

    def itl(self, batch: int) -> float:
        return self.itl_base_s + self.itl_per_seq_s * max(batch, 1)

    def decode_tok_s(self, batch: int | None = None) -> float:
        """Tokens per second a decode worker makes with `batch` sequences (default: a full batch)."""
        b = self.max_batch if batch is None else batch
        return b / self.itl(b)

    @classmethod
    def from_rates(cls, prefill_tok_s: float, decode_tok_s: float, slo_itl_s: float, headroom: float = 0.8,
                   base_share: float = 0.5) -> ServiceModel:
        """A model with the given per-worker rates, for when only rates were measured.

        A full decode batch runs at `headroom x ITL SLO` per step, of which `base_share` is the fixed
        weight-reading cost: the batch size follows as decode_tok_s x step time.
        """
        for name, value in (("prefill_tok_s", prefill_tok_s), ("decode_tok_s", decode_tok_s),
                            ("slo_itl_s", slo_itl_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"service model: {name} must be > 0, got {value}")
        if not (0 < headroom <= 1 and 0 < base_share < 1):
            raise ValueError("service model: headroom must be in (0, 1] and base_share in (0, 1)")
        step = slo_itl_s * headroom
        batch = max(1, round(decode_tok_s * step))
        base = step * base_share
        return cls(prefill_tok_s=prefill_tok_s, itl_base_s=base, itl_per_seq_s=(step - base) / batch,
                   max_batch=batch)

    @classmethod
    def from_curve(cls, points: list[CurvePoint], slo_itl_s: float | None) -> ServiceModel:
        """Fit a model to a colocated worker's curve (`tandem bench` points).

        The prefill rate is the lowest-concurrency point's mean input over its P50 TTFT (no queueing there);
        itl(b) is a least-squares line through (concurrency, P50 ITL); the batch cap is where that line reaches
        the ITL SLO (the largest measured concurrency without an SLO).
        """
        rates = fitted_prefill_rate(points)
        xs = np.array([p.concurrency for p in points if p.itl_p50_s is not None], dtype=float)
        ys = np.array([p.itl_p50_s for p in points if p.itl_p50_s is not None], dtype=float)
        if len(xs) == 0:
            raise ValueError("fitting a decode model needs points with a P50 ITL")
        if len(np.unique(xs)) >= 2:
            slope, intercept = np.polyfit(xs, ys, 1)
        else:
            slope, intercept = 0.0, float(ys.mean())
        if slope < 0:  # noise on a flat curve: no evidence that batching slows steps down
            slope, intercept = 0.0, float(ys.mean())
        if intercept <= 0:  # keep the line through the data but with a positive fixed cost
            intercept = float(ys.min()) / 2
            slope = max(float(np.mean((ys - intercept) / xs)), 0.0)
        if slo_itl_s is not None and slope > 0:
            max_batch = max(1, math.floor((slo_itl_s - intercept) / slope))
        else:
            max_batch = max(1, int(xs.max()))
        return cls(prefill_tok_s=rates, itl_base_s=float(intercept), itl_per_seq_s=float(slope),
                   max_batch=max_batch)


def fitted_prefill_rate(points: list[CurvePoint]) -> float:
    """Prompt tokens/s from the lowest-concurrency point: mean input tokens / P50 TTFT."""
    usable = [p for p in points if p.mean_input_tokens and p.ttft_p50_s]
    if not usable:
        raise ValueError("fitting a prefill rate needs a point with mean_input_tokens and ttft_p50_s")
    low = min(usable, key=lambda p: p.concurrency)
    return low.mean_input_tokens / low.ttft_p50_s


def fitted_decode_rate(points: list[CurvePoint], slo_itl_s: float | None, percentile: Percentile) -> float:
    """Tokens/s one worker's decode batch makes within the ITL SLO: concurrency / P50 ITL at the highest
    concurrency whose ITL percentile meets it (the lowest point when none does)."""
    usable = [p for p in points if p.itl_p50_s]
    if not usable:
        raise ValueError("fitting a decode rate needs points with itl_p50_s")
    best = find_c_max(usable, None, slo_itl_s, percentile) if slo_itl_s is not None else usable[-1]
    best = best or min(usable, key=lambda p: p.concurrency)
    return best.concurrency / best.itl_p50_s
