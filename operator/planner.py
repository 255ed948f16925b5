"""Planner mode, the operator's side: on each tick read a metrics window, ask the policy, record the decision
in `status.planner` and resize the pools through the ordinary reconcile path (no kopf in here).

The policy's state between ticks is the current pool sizes and when they last changed; both live in
`status.planner`, read fresh from the API server at every tick, so neither a stale watch event nor an operator
restart can make the planner forget a change (and undo it, or skip its cooldown).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tandem.operator import names
from tandem.operator.crd import LLMDeploymentSpec, ScalingSpec
from tandem.operator.kube import Kube, Outcome
from tandem.operator.reconcile import StatusKeeper, reconcile
from tandem.operator.scaling import planned_sizes, planner_limits, planner_mode
from tandem.operator.sizing import PoolSizes
from tandem.operator.validation import SpecError, validate_spec
from tandem.planning.policy import FleetState, MetricsWindow, recommend

log = logging.getLogger("tandem.operator.planner")

# Reads one LLMDeployment's metrics window; None while there is not enough data for one (the first scrape).
MetricsSource = Callable[[Mapping[str, Any]], MetricsWindow | None]
DEFAULT_INTERVAL_S = ScalingSpec.model_fields["interval_seconds"].default


def timestamp(epoch_s: float) -> str:
    """RFC 3339 with milliseconds: cooldowns shorter than a second (tests) still measure right."""
    moment = datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None  # not ours (hand-edited): no cooldown is better than no planner


@dataclasses.dataclass(frozen=True)
class Decision:
    """One tick's outcome: the sizes before and after, why, and what reconcile did to the objects."""

    before: tuple[int, int]
    after: tuple[int, int]
    reason: str
    outcomes: list[tuple[Outcome, dict]]

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def message(self) -> str:
        return (f"prefill {self.before[0]}->{self.after[0]}, decode {self.before[1]}->{self.after[1]}: "
                f"{self.reason}")


class Planner:
    """Runs the planner for every LLMDeployment in planner mode; `tick_s` is how often kopf asks, and each
    resource is decided at most once per its `spec.scaling.intervalSeconds`."""

    def __init__(self, kube: Kube, keeper: StatusKeeper, source: MetricsSource, tick_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        if tick_s <= 0:
            raise ValueError(f"planner tick must be > 0 seconds, got {tick_s}")
        self.kube, self.keeper, self.source, self.tick_s, self.clock = kube, keeper, source, tick_s, clock
        self._last_run: dict[str, float] = {}
        self._guard = threading.Lock()

    def due(self, body: Mapping[str, Any]) -> bool:
        """In planner mode, its current spec handled, and its interval passed since the last decision here."""
        scaling = (body.get("spec") or {}).get("scaling") or {}
        if scaling.get("mode") != "planner":
            return False
        # Wait for the spec handler to have applied this generation: the planner's status writes would
        # otherwise race kopf's own first patches of a new resource (finalizer, progress annotations).
        observed = (body.get("status") or {}).get("observedGeneration")
        if observed is None or observed < (body["metadata"].get("generation") or 1):
            return False
        interval = scaling.get("intervalSeconds", DEFAULT_INTERVAL_S)
        now, uid = self.clock(), body["metadata"]["uid"]
        with self._guard:
            if now - self._last_run.get(uid, -float("inf")) < interval:
                return False
            self._last_run[uid] = now
        return True

    def forget(self, uid: str) -> None:
        """Drops the last decision's time of a deleted LLMDeployment."""
        with self._guard:
            self._last_run.pop(uid, None)

    def tick(self, namespace: str, name: str) -> Decision | None:
        """Decide once for one LLMDeployment; None when it is gone, invalid, not in planner mode, or its spec
        changed while its metrics were read (its own reconcile applies that; the next tick plans for it)."""
        plannable = self._plannable(namespace, name)
        if plannable is None:
            return None
        scraped, spec, spec_sizes = plannable
        # Read the metrics outside the lock: scraping every pod takes a while, and spec changes and status
        # refreshes of this resource must not wait for it.
        try:
            window = self.source(scraped)
        except Exception as exc:  # noqa: BLE001 (the source is pluggable; its failure is reported, not fatal)
            log.warning("planner metrics for %s/%s: %s", namespace, name, exc)
            window, reason = None, f"holding: no metrics ({exc})"
        else:
            reason = "holding: waiting for a second metrics sample"
        with self.keeper.lock(namespace, name):
            # Read again for its status; an unchanged generation means an unchanged spec (mode included).
            body = self.kube.get(names.API_VERSION, names.KIND, namespace, name)
            if (body is None or body["metadata"].get("deletionTimestamp")
                    or body["metadata"].get("generation") != scraped["metadata"].get("generation")):
                return None  # switched to manual, edited or deleted meanwhile: this window's decision is stale
            status = body.get("status") or {}
            previous = status.get("planner") or {}
            current = planned_sizes(spec, spec_sizes, status)
            fleet = FleetState(current.prefill, current.decode, parse_timestamp(previous.get("lastChange")))
            now = self.clock()
            if window is not None:
                # The cooldown is measured on the clock lastChange is written with, whatever the source used.
                rec = recommend(dataclasses.replace(window, end_s=now), fleet, planner_limits(spec))
                after, reason = (rec.prefill, rec.decode), rec.reason
            else:
                after = (current.prefill, current.decode)
            before = (current.prefill, current.decode)
            planner = {"prefill": after[0], "decode": after[1], "reason": reason,
                       "lastChange": timestamp(now) if after != before else previous.get("lastChange")}
            if planner != previous:
                self.kube.patch_status(names.API_VERSION, names.KIND, namespace, name, {"planner": planner})
            body = {**body, "status": {**status, "planner": planner}}
            # Resize through reconcile: the Deployments and the router's ConfigMap are rebuilt from the new
            # sizes, exactly as a spec change would rebuild them (under the lock every reconcile takes).
            outcomes = reconcile(self.kube, body) if after != before or not previous else []
        return Decision(before, after, reason, outcomes)

    def _plannable(self, namespace: str, name: str
                   ) -> tuple[Mapping[str, Any], LLMDeploymentSpec, PoolSizes] | None:
        """(the resource as it is now, its spec, the spec's pool sizes) if it exists, is valid and is in planner
        mode."""
        body = self.kube.get(names.API_VERSION, names.KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        try:
            spec, sizes = validate_spec(body.get("spec"), name)
        except SpecError:
            return None  # the status already says why; nothing to plan for
        return (body, spec, sizes) if planner_mode(spec) else None
