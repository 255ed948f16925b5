"""Planner mode, the pure part: the policy's limits from a spec, and the pool sizes a resource asks for now.

In planner mode the spec's sizes are only the starting point: once the planner decided, `status.planner`
holds the sizes, and every reconcile (spec change, resync, restore) builds the Deployments from those, so
the planner and the rest of the operator never fight over `replicas`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from tandem.config import LLMDeploymentSpec
from tandem.operator.sizing import PoolSizes
from tandem.planning.policy import PlannerLimits

GPU_RESOURCE = "nvidia.com/gpu"


def planner_mode(spec: LLMDeploymentSpec) -> bool:
    return spec.scaling.mode == "planner"


def gpus_per_replica(spec: LLMDeploymentSpec) -> int:
    """GPUs one worker holds: its GPU limit (or request), else the tensor-parallel degree.

    The policy takes one figure for both pools; the larger pool figure keeps the budget a hard limit.
    """
    counts = [spec.engine.tensor_parallel_size]
    counts += [g for g in (pool_gpus(spec.prefill.resources), pool_gpus(spec.decode.resources)) if g is not None]
    return max(max(counts), 1)


def pool_gpus(resources) -> int | None:
    """A pool's GPUs per worker, from its limit (or request); None when it names none. ValueError for a quantity
    that is no whole number: Kubernetes counts extended resources in whole units ("2", "1.0", "2000m")."""
    for bucket in (resources.limits, resources.requests) if resources is not None else ():
        if bucket and GPU_RESOURCE in bucket:
            quantity = str(bucket[GPU_RESOURCE])  # its form was checked by ResourceRequirements (QUANTITY_PATTERN)
            value = parse_quantity(quantity)
            if value < 0 or value != value.to_integral_value():
                raise ValueError(f"{GPU_RESOURCE} {quantity!r} is not a whole number of GPUs")
            return int(value)
    return None


def planner_limits(spec: LLMDeploymentSpec) -> PlannerLimits:
    """The policy's limits for `spec.scaling`; ValueError when they contradict each other (budget < minimums)."""
    scaling = spec.scaling
    down = scaling.cooldown_seconds if scaling.scale_down_cooldown_seconds is None \
        else scaling.scale_down_cooldown_seconds
    return PlannerLimits(
        min_prefill=scaling.prefill.min, max_prefill=scaling.prefill.max,
        min_decode=scaling.decode.min, max_decode=scaling.decode.max,
        gpus_per_replica=gpus_per_replica(spec), gpu_budget=scaling.gpu_budget,
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
    """Sizes within the pools' min..max and the GPU budget; over budget, both pools shrink to fill it in
    their current proportion (rounded half up for prefill, as `split_by_ratio` does)."""
    prefill = min(max(prefill, limits.min_prefill), limits.max_prefill)
    decode = min(max(decode, limits.min_decode), limits.max_decode)
    budget = None if limits.gpu_budget is None else limits.gpu_budget // limits.gpus_per_replica
    if budget is not None and prefill + decode > budget:
        # PlannerLimits guarantees min_prefill + min_decode <= budget, so both minimums fit.
        share = math.floor(budget * prefill / (prefill + decode) + 0.5)
        prefill = min(max(share, limits.min_prefill), budget - limits.min_decode)
        decode = min(budget - prefill, limits.max_decode)
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
