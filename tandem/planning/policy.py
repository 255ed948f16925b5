"""The planner policy: measured load in, prefill and decode replica counts out.

`recommend(metrics_window, current, limits)` is a pure function: the operator's planner mode calls it on a
timer with what the routers measured, the simulator calls it on simulated time, and tests call it directly.
Any state it needs (when replicas last changed) comes in through `current`.

How it decides, per pool:
  need      = work arriving per second / (one replica's capacity x target utilization)
              prefill: arrival_rps x mean input tokens  (+ queued prompt tokens / backlog_drain_s)
              decode:  arrival_rps x mean output tokens (+ queued output tokens / backlog_drain_s)
  scale up  when need > current x (1 + hysteresis), to ceil(need)
  scale down when need < current x (1 - hysteresis), to ceil(need)
  otherwise hold. Moving only past the band and then to ceil(need) is what rules out oscillation: after a
  move the new count c' >= need, and moving back needs the load to cross the far side of the band around c'.
  Cooldowns: no scale-up within `scale_up_cooldown_s` of the last change, no scale-down within
  `scale_down_cooldown_s` (longer: capacity is cheap to keep and slow to bring back).
  Limits: each pool is clamped to [min, max]; when the GPUs wanted exceed the budget, both needs are scaled
  down together (keeping the P:D balance) before the band is applied, and the result is trimmed to fit. A pool's
  GPUs are its replicas x the GPUs one of its replicas holds (its tensor-parallel size), which may differ by pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.planning.sizing import ceil_count


@dataclass(frozen=True)
class MetricsWindow:
    """What the routers measured over one window.

    `prefill_tok_s_per_replica` is one prefill worker's capacity: prompt tokens per second of busy time (the
    router's EWMA prefill rate); `decode_tok_s_per_replica` the tokens per second one decode worker makes within
    the ITL SLO with a full batch (from the measured curve or rates).
    """

    end_s: float
    arrival_rps: float
    mean_input_tokens: float
    mean_output_tokens: float
    prefill_tok_s_per_replica: float
    decode_tok_s_per_replica: float
    prefill_backlog_tokens: float = 0.0
    decode_backlog_tokens: float = 0.0

    def __post_init__(self):
        for name in ("arrival_rps", "mean_input_tokens", "mean_output_tokens", "prefill_backlog_tokens",
                     "decode_backlog_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"metrics window: {name} must be a finite number >= 0, got {value}")
        for name in ("prefill_tok_s_per_replica", "decode_tok_s_per_replica"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"metrics window: {name} must be > 0, got {value}")
        if not math.isfinite(self.end_s):
            raise ValueError(f"metrics window: end_s must be finite, got {self.end_s}")


@dataclass(frozen=True)
class FleetState:
    """Replicas the pools have now (ready or starting, not draining) and when they last changed."""

    prefill: int
    decode: int
    last_change_s: float | None = None

    def __post_init__(self):
        if self.prefill < 0 or self.decode < 0:
            raise ValueError(f"fleet state: replicas must be >= 0, got {self.prefill}:{self.decode}")


@dataclass(frozen=True)
class PlannerLimits:
    min_prefill: int = 1
    max_prefill: int = 1000
    min_decode: int = 1
    max_decode: int = 1000
    prefill_gpus_per_replica: int = 1
    decode_gpus_per_replica: int = 1
    gpu_budget: int | None = None
    target_utilization: float = 0.8
    hysteresis: float = 0.2
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    backlog_drain_s: float = 60.0

    def __post_init__(self):
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"planner limits: need 0 <= min_prefill <= max_prefill, got "
                             f"{self.min_prefill}..{self.max_prefill}")
        if not 0 <= self.min_decode <= self.max_decode:
            raise ValueError(f"planner limits: need 0 <= min_decode <= max_decode, got "
                             f"{self.min_decode}..{self.max_decode}")
        for name in ("prefill_gpus_per_replica", "decode_gpus_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner limits: {name} must be at least 1, got {getattr(self, name)}")
        if self.gpu_budget is not None and self.gpus(self.min_prefill, self.min_decode) > self.gpu_budget:
            raise ValueError(f"planner limits: the minimum pools ({self.min_prefill} x "
                             f"{self.prefill_gpus_per_replica} + {self.min_decode} x {self.decode_gpus_per_replica} "
                             f"GPUs) exceed the GPU budget of {self.gpu_budget}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"planner limits: target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"planner limits: hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"planner limits: {name} must be >= 0, got {getattr(self, name)}")
        if self.backlog_drain_s <= 0:
            raise ValueError(f"planner limits: backlog_drain_s must be > 0, got {self.backlog_drain_s}")

    def gpus(self, prefill: float, decode: float) -> float:
        """GPUs `prefill` and `decode` replicas hold together."""
        return prefill * self.prefill_gpus_per_replica + decode * self.decode_gpus_per_replica


@dataclass(frozen=True)
class Recommendation:
    prefill: int
    decode: int
    reason: str

    def changes(self, current: FleetState) -> bool:
        return (self.prefill, self.decode) != (current.prefill, current.decode)


def replicas_needed(window: MetricsWindow, limits: PlannerLimits) -> tuple[float, float]:
    """(prefill, decode) replicas the measured load needs at the target utilization (fractional)."""
    prefill_work = window.arrival_rps * window.mean_input_tokens + window.prefill_backlog_tokens / limits.backlog_drain_s
    decode_work = window.arrival_rps * window.mean_output_tokens + window.decode_backlog_tokens / limits.backlog_drain_s
    util = limits.target_utilization
    return (prefill_work / (window.prefill_tok_s_per_replica * util),
            decode_work / (window.decode_tok_s_per_replica * util))


def _banded(name: str, need: float, current: int, hysteresis: float) -> tuple[int, str]:
    """Apply the hysteresis band to one pool: (target, why)."""
    low, high = current * (1 - hysteresis), current * (1 + hysteresis)
    if need > high and ceil_count(need) > current:
        return ceil_count(need), f"{name} {current}->{ceil_count(need)}: needs {need:.2f} > {high:.2f}"
    if need < low and ceil_count(need) < current:
        return ceil_count(need), f"{name} {current}->{ceil_count(need)}: needs {need:.2f} < {low:.2f}"
    return current, f"{name} holds {current}: needs {need:.2f}, band {low:.2f}..{high:.2f}"


def recommend(metrics_window: MetricsWindow, current: FleetState, limits: PlannerLimits) -> Recommendation:
    """Prefill and decode replicas for the measured load, with the reason (see the module docstring)."""
    need_p, need_d = replicas_needed(metrics_window, limits)
    reasons = []
    budget = limits.gpu_budget
    if budget is not None and limits.gpus(ceil_count(need_p), ceil_count(need_d)) > budget:
        # Scale both needs by one factor so the pools shrink together and the P:D balance survives the cap.
        scale = budget / limits.gpus(need_p, need_d)
        need_p, need_d = need_p * scale, need_d * scale
        reasons.append(f"needs scaled by {scale:.2f} to fit the {limits.gpu_budget}-GPU budget")

    target_p, why_p = _banded("prefill", need_p, current.prefill, limits.hysteresis)
    target_d, why_d = _banded("decode", need_d, current.decode, limits.hysteresis)
    reasons += [why_p, why_d]

    since = math.inf if current.last_change_s is None else metrics_window.end_s - current.last_change_s
    for pool, cur in (("prefill", current.prefill), ("decode", current.decode)):
        target = target_p if pool == "prefill" else target_d
        cooldown = limits.scale_up_cooldown_s if target > cur else limits.scale_down_cooldown_s
        if target != cur and since < cooldown:
            reasons.append(f"{pool} kept at {cur}: cooldown, {cooldown - since:.0f} s left")
            target = cur
        if pool == "prefill":
            target_p = target
        else:
            target_d = target

    clamped_p = min(max(target_p, limits.min_prefill), limits.max_prefill)
    clamped_d = min(max(target_d, limits.min_decode), limits.max_decode)
    if (clamped_p, clamped_d) != (target_p, target_d):
        reasons.append(f"clamped to prefill {limits.min_prefill}..{limits.max_prefill}, "
                       f"decode {limits.min_decode}..{limits.max_decode}")
    target_p, target_d = clamped_p, clamped_d

    if budget is not None and limits.gpus(target_p, target_d) > budget:
        # Trim the pool with the most replicas beyond its need first; the budget is a hard limit.
        while limits.gpus(target_p, target_d) > budget:
            spare_p = target_p - need_p if target_p > limits.min_prefill else -math.inf
            spare_d = target_d - need_d if target_d > limits.min_decode else -math.inf
            if spare_p >= spare_d:
                target_p -= 1
            else:
                target_d -= 1
        reasons.append(f"trimmed to {target_p}+{target_d} replicas ({limits.gpus(target_p, target_d)} GPUs) for "
                       f"the {limits.gpu_budget}-GPU budget")
    return Recommendation(target_p, target_d, "; ".join(reasons))
