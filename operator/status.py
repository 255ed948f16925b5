"""Status of an LLMDeployment, computed from its spec and the objects observed in the cluster (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator import devices, names
from tandem.operator.builders import kept_replicas
from tandem.operator.crd import LLMDeploymentSpec, LLMDeploymentStatus
from tandem.operator.scaling import planned_sizes, planner_mode
from tandem.operator.sizing import PoolSizes
from tandem.operator.validation import SpecError, validate_spec


@dataclass(frozen=True)
class ComponentState:
    """What one owned Deployment says about its rollout."""

    desired: int
    ready: int
    updated: int
    exists: bool
    rolling_out: bool  # new pods are still being brought up (a normal, temporary shortfall)
    stalled: str | None  # why the Deployment controller gave up, if it did
    scale_up_from: int | None = None  # a scale-up under way: the ready replicas it started from

    @property
    def scaling_up(self) -> bool:
        """New pods of a scale-up are starting, and none of those it started with is lost."""
        return self.exists and self.stalled is None and self.scale_up_from is not None and \
            self.ready >= self.scale_up_from

    @property
    def progressing(self) -> bool:
        return self.rolling_out or self.scaling_up

    @property
    def degraded(self) -> bool:
        return self.stalled is not None or (self.exists and not self.progressing and self.ready < self.desired)


@dataclass(frozen=True)
class Problem:
    """What the last reconcile could not do, which the owned objects alone do not show: the API server refused
    what the spec builds (`refused`: the spec is reported invalid), or applying it failed (reported degraded)."""

    refused: bool
    message: str


# The Deployment controller's Progressing reason once the newest ReplicaSet is fully available.
ROLLOUT_COMPLETE = "NewReplicaSetAvailable"


def scale_up_from(before: Mapping[str, Any], desired: int, ready: int) -> int | None:
    """The ready replicas a scale-up under way started from (None when none is under way), from the component's
    previous status (`before`): one starts when the desired replicas of a component that ran rise, and lasts until
    it is full."""
    if ready >= desired:
        return None
    if before.get("scaleUpFrom") is not None:
        return min(before["scaleUpFrom"], desired)
    previous = before.get("desired") or 0
    return min(before.get("ready") or 0, previous) if 0 < previous < desired else None


def component_state(deployment: Mapping[str, Any] | None, desired: int,
                    before: Mapping[str, Any] | None = None) -> ComponentState:
    """Rollout state of one Deployment, read the way `kubectl rollout status` reads it; `before` is the component's
    previous status.

    A shortfall of ready pods is "rolling out" while the controller still works on the newest ReplicaSet
    (models take minutes to load), "scaling up" while the new pods of a scale-up start, and "degraded" once the
    controller called the rollout complete or gave up, or a pod that ran before the scale-up is lost.
    """
    if deployment is None:
        return ComponentState(desired, 0, 0, exists=False, rolling_out=False, stalled=None)
    meta, status = deployment.get("metadata", {}), deployment.get("status") or {}
    ready = status.get("readyReplicas") or 0
    updated = status.get("updatedReplicas") or 0
    available = status.get("availableReplicas") or 0
    total = status.get("replicas") or 0
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    seen = generation is None or (observed is not None and observed >= generation)
    spec_replicas = deployment.get("spec", {}).get("replicas", desired)
    complete = seen and spec_replicas == desired and updated >= desired and available >= desired and total <= desired
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    progressing, failure = conditions.get("Progressing"), conditions.get("ReplicaFailure")
    stalled = None
    if progressing is not None and progressing.get("status") == "False":
        stalled = progressing.get("reason") or "ProgressDeadlineExceeded"
    elif failure is not None and failure.get("status") == "True":
        stalled = failure.get("reason") or "ReplicaFailure"
    if progressing is not None and seen and spec_replicas == desired:
        rolling_out = stalled is None and progressing.get("reason") != ROLLOUT_COMPLETE
    else:  # no word from the controller yet (or a spec it has not seen): judge by the counts
        rolling_out = stalled is None and not complete
    return ComponentState(desired, ready, updated, exists=True, rolling_out=rolling_out, stalled=stalled,
                          scale_up_from=scale_up_from(before or {}, desired, ready))


def router_endpoint(service: Mapping[str, Any] | None) -> str | None:
    """The router's base URL: the load balancer's address once it has one, else the cluster DNS name."""
    if service is None:
        return None
    meta, spec = service["metadata"], service.get("spec", {})
    port = (spec.get("ports") or [{}])[0].get("port", names.HTTP_PORT)
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    if spec.get("type") == "LoadBalancer" and ingress:
        host = ingress[0].get("ip") or ingress[0].get("hostname")
        if host:
            return f"http://{host}:{port}"
    return f"http://{meta['name']}.{meta['namespace']}.svc:{port}"


def _condition(kind: str, ok: bool, reason: str, message: str, now: str, previous: Mapping[str, dict],
               generation: int | None) -> dict:
    status = "True" if ok else "False"
    before = previous.get(kind)
    # lastTransitionTime moves only when the status flips, as Kubernetes conventions ask.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since,
            "observedGeneration": generation}


def compute_status(resource: Mapping[str, Any], deployments: Mapping[str, Mapping[str, Any]],
                   router_svc: Mapping[str, Any] | None, now: str, generation: int | None = None,
                   problem: Problem | None = None) -> dict:
    """status for `resource` (the LLMDeployment body).

    `deployments` maps a component (prefill, decode, router) to its observed Deployment; `generation` is
    the spec generation just reconciled (None keeps the status' observedGeneration as it was); `problem` is
    what the last reconcile could not do.
    """
    meta = resource.get("metadata", {})
    old = resource.get("status") or {}
    previous = {c.get("type"): c for c in old.get("conditions") or []}
    observed_generation = generation if generation is not None else old.get("observedGeneration")
    try:
        spec, sizes = validate_spec(resource.get("spec"), meta.get("name", ""))
        if problem is not None and problem.refused:  # valid on its face, refused by the API server
            raise SpecError([problem.message])
        sizes = planned_sizes(spec, sizes, old)
        # The planner's decision is the planner's to write; manual mode drops it (a later switch starts afresh).
        planner = old.get("planner") if planner_mode(spec) else None
        asked = {"prefill": sizes.prefill, "decode": sizes.decode, "router": spec.router.replicas}
        desired = {c: kept_replicas(deployments.get(c), n) for c, n in asked.items()}
        gpus = fleet_gpus(spec, sizes)
        spec_error = None
    except SpecError as exc:
        spec_error = str(exc)
        planner, gpus = old.get("planner"), old.get("gpus")
        # Nothing of it was applied: what runs is what the last valid spec asked for. A Deployment deleted meanwhile
        # is not put back until the spec is fixed; the last status still says what it was to run.
        desired = {c: (deployments.get(c) or {}).get("spec", {}).get("replicas", (old.get(c) or {}).get("desired", 0))
                   for c in names.COMPONENTS}
    states = {c: component_state(deployments.get(c), desired[c], old.get(c)) for c in names.COMPONENTS}

    summary = ", ".join(f"{c} {s.ready}/{s.desired}" for c, s in states.items())
    # The newest spec is not what runs until a reconcile of its generation went through (one that failed to apply
    # leaves observedGeneration behind): not ready, whatever the replicas of the spec before say.
    generation_now = meta.get("generation")
    behind = spec_error is None and generation_now is not None and (observed_generation or 0) < generation_now
    ready = spec_error is None and not behind and all(s.exists and not s.progressing and s.ready >= s.desired
                                                      for s in states.values())
    stalled = [f"{c}: {s.stalled}" for c, s in states.items() if s.stalled]
    # Under a valid spec a missing Deployment is being made (or put back at once); under an invalid one it stays gone.
    missing = [c for c, s in states.items() if not s.exists and s.desired > 0] if spec_error is not None else []
    short = [c for c, s in states.items() if s.degraded and not s.stalled]
    apply_failed = problem.message if problem is not None and not problem.refused else None
    degraded = bool(stalled or missing or short or apply_failed)
    progressing = spec_error is None and any(s.exists and s.progressing for s in states.values())
    # A Deployment controller says nothing of a scale-up (its Progressing condition stays NewReplicaSetAvailable).
    rolling_out = any(s.exists and s.rolling_out for s in states.values())
    progressing_reason, progress = ("RollingOut", "rolling out") if rolling_out else ("ScalingUp", "scaling up")
    if degraded:
        degraded_reason = "ApplyFailed" if apply_failed else "RolloutStalled" if stalled else \
            "DeploymentMissing" if missing else "ReplicasUnavailable"
        degraded_message = "; ".join(([apply_failed] if apply_failed else []) + stalled
                                     + [f"the {c} Deployment is missing" for c in missing]) or \
            f"missing ready replicas in {', '.join(short)}"
    else:
        degraded_reason, degraded_message = "AsExpected", "all is well"
    if spec_error is not None:  # not ready whatever runs: the spec asked for is not what runs
        ready_reason, ready_message = "InvalidSpec", f"the spec is not applied (see SpecValid); running: {summary}"
    elif behind:
        ready_reason = "SpecNotApplied"
        ready_message = f"generation {generation_now} is not applied yet (see Degraded); running: {summary}"
    else:
        ready_reason, ready_message = ("AllReplicasReady" if ready else "ReplicasNotReady"), f"ready: {summary}"

    conditions = [
        _condition("SpecValid", spec_error is None, "Valid" if spec_error is None else "InvalidSpec",
                   spec_error or "the spec is valid", now, previous, observed_generation),
        _condition("Ready", ready, ready_reason, ready_message, now, previous, observed_generation),
        _condition("Progressing", progressing, progressing_reason if progressing else "Idle",
                   f"{progress}: {summary}" if progressing else "no rollout in progress", now, previous,
                   observed_generation),
        _condition("Degraded", degraded, degraded_reason, degraded_message, now, previous, observed_generation),
    ]
    if spec_error is not None:
        phase = "Invalid"
    elif ready:
        phase = "Ready"
    elif degraded:
        phase = "Degraded"
    elif progressing:
        phase = "Progressing"
    else:
        phase = "Pending"
    workers_and_router = sum(s.ready for s in states.values()), sum(s.desired for s in states.values())
    status = LLMDeploymentStatus(
        phase=phase,
        observed_generation=observed_generation,
        prefill=_pool_status(states["prefill"]),
        decode=_pool_status(states["decode"]),
        router=_pool_status(states["router"]),
        ready=f"{workers_and_router[0]}/{workers_and_router[1]}",
        ratio=f"{states['prefill'].ready}:{states['decode'].ready}",
        endpoint=router_endpoint(router_svc),
        gpus=gpus,
        replicas=states["prefill"].desired + states["decode"].desired,
        selector=names.workers_selector(meta.get("name", "")),
        conditions=conditions,
        planner=planner,
    )
    # Every field is written, None included: a merge patch then removes what no longer applies.
    return status.model_dump(by_alias=True, mode="json")


def fleet_gpus(spec: LLMDeploymentSpec, sizes: PoolSizes) -> int | None:
    """GPUs the desired workers hold: each pool's replicas x its GPUs per worker; None on CPU."""
    gpus = sum(getattr(sizes, pool) * devices.worker_gpus(spec, pool) for pool in names.POOLS)
    return gpus or None


def _pool_status(state: ComponentState) -> dict:
    return {"desired": state.desired, "ready": state.ready, "updated": state.updated,
            "scaleUpFrom": state.scale_up_from}


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal up to what a merge patch would not change (missing keys vs explicit nulls)."""

    def strip(value):
        if isinstance(value, Mapping):
            return {k: strip(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(a or {}) == strip(b or {})
