"""Planner mode, the pure part: the policy's limits from a spec, and the pool sizes a resource asks for now.

In planner mode the spec's sizes are only the starting point: once the planner decided, `status.planner`
holds the sizes, and every reconcile (spec change, resync, restore) builds the Deployments from those, so
the planner and the rest of the operator never fight over `replicas`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tandem.operator import devices
from tandem.operator.crd import LLMDeploymentSpec
from tandem.operator.sizing import PoolSizes
from tandem.planning.policy import PlannerLimits


def planner_mode(spec: LLMDeploymentSpec) -> bool:
    return spec.scaling.mode == "planner"


def budget_gpus(spec: LLMDeploymentSpec, pool: str) -> int:
    """What one worker of `pool` counts against spec.scaling.gpuBudget: its GPUs (devices.worker_gpus), or on CPU
    its ranks."""
    return devices.worker_gpus(spec, pool) or devices.pool_tp(spec, pool)


def planner_limits(spec: LLMDeploymentSpec) -> PlannerLimits:
    """The policy's limits for `spec.scaling`; ValueError when they contradict each other (budget < minimums)."""
    scaling = spec.scaling
    down = scaling.cooldown_seconds if scaling.scale_down_cooldown_seconds is None \
        else scaling.scale_down_cooldown_seconds
    return PlannerLimits(
        min_prefill=scaling.prefill.min, max_prefill=scaling.prefill.max,
        min_decode=scaling.decode.min, max_decode=scaling.decode.max,
        prefill_gpus_per_replica=budget_gpus(spec, "prefill"), decode_gpus_per_replica=budget_gpus(spec, "decode"),
        gpu_budget=scaling.gpu_budget,
        target_utilization=scaling.target_utilization, hysteresis=scaling.hysteresis,
        scale_up_cooldown_s=scaling.cooldown_seconds, scale_down_cooldown_s=down)


def scaling_reasons(spec: LLMDeploymentSpec) -> list[str]:
    """What makes `spec.scaling` unusable (checked only in planner mode: manual mode ignores it)."""
    if not planner_mode(spec):
        return []
    reasons = []
    if spec.scaling.decode.min < 1:
        reasons.append("spec.scaling.decode.min: must be at least 1: decode workers generate every response")
    try:
        planner_limits(spec)
    except ValueError as exc:
        reasons.append(f"spec.scaling: {str(exc).removeprefix('planner limits: ')}")
    return reasons


def clamp_to_limits(prefill: int, decode: int, limits: PlannerLimits) -> PoolSizes:
    """Sizes within the pools' min..max and the GPU budget (each pool's replicas x its GPUs per replica); over
    budget, both pools shrink by one factor to fill it (prefill rounded half up, as `split_by_ratio` does), and
    decode takes the GPUs prefill leaves."""
    prefill = min(max(prefill, limits.min_prefill), limits.max_prefill)
    decode = min(max(decode, limits.min_decode), limits.max_decode)
    budget, per_p, per_d = limits.gpu_budget, limits.prefill_gpus_per_replica, limits.decode_gpus_per_replica
    if budget is not None and limits.gpus(prefill, decode) > budget:
        # PlannerLimits guarantees that the minimum pools fit the budget.
        share = math.floor(prefill * budget / limits.gpus(prefill, decode) + 0.5)
        prefill = min(max(share, limits.min_prefill), (budget - limits.min_decode * per_d) // per_p)
        decode = min((budget - prefill * per_p) // per_d, limits.max_decode)
    return PoolSizes(prefill=prefill, decode=decode)


def planned_sizes(spec: LLMDeploymentSpec, spec_sizes: PoolSizes, status: Mapping[str, Any] | None) -> PoolSizes:
    """The pool sizes to build now: the spec's in manual mode; in planner mode the planner's latest
    decision (or the spec's as the starting point), always within the current limits."""
    if not planner_mode(spec):
        return spec_sizes
    planner = (status or {}).get("planner") or {}
    prefill, decode = planner.get("prefill"), planner.get("decode")
    if not isinstance(prefill, int) or not isinstance(decode, int):
        prefill, decode = spec_sizes.prefill, spec_sizes.decode
    return clamp_to_limits(prefill, decode, planner_limits(spec))
