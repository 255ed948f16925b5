"""The planner's production metrics source: scrape every router and worker pod's /metrics and turn the
counter deltas between two ticks into a `MetricsWindow`.

Targets come from the EndpointSlices of the deployment's three Services (the operator already reads
EndpointSlices), so each pod is scraped directly: through the router's load-balanced Service every scrape
would hit a different router and the counters would not line up between ticks.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tandem.operator import names
from tandem.operator.crd import LLMDeploymentSpec
from tandem.operator.kube import Kube
from tandem.planning.policy import MetricsWindow

log = logging.getLogger("tandem.operator.planner")

REQUESTS = "tandem_router_requests_total"  # answered in full
FAILED = "tandem_router_failed_requests_total"
ABANDONED = "tandem_router_abandoned_requests_total"  # their clients left before the end
REFUSED = "tandem_router_rejections_total"  # only the reasons below: what more worker replicas would have served
CAPACITY_REFUSALS = {"slo_unmeetable", "queue_full", "no_workers", "decode_capacity"}  # not dispatch_slots: the router's own cap
PROMPT_TOKENS = "tandem_prompt_tokens_total"
COMPUTED_PROMPT_TOKENS = "tandem_computed_prompt_tokens_total"
GENERATION_TOKENS = "tandem_generation_tokens_total"
FINISHED = "tandem_requests_finished_total"  # on a worker, whatever the reason
WAITING = "tandem_num_requests_waiting"
SCRAPED = (REQUESTS, FAILED, ABANDONED, REFUSED, PROMPT_TOKENS, COMPUTED_PROMPT_TOKENS, GENERATION_TOKENS, FINISHED,
           WAITING)


@dataclass(frozen=True)
class Sample:
    """One scrape of every pod: when, and per (component, address) the summed series in SCRAPED."""

    at_s: float
    targets: Mapping[tuple[str, str], Mapping[str, float]]
    missed: int = 0  # ready pods whose /metrics could not be read

    def pods(self, component: str, since: Sample | None = None) -> int:
        """The component's pods scraped; with `since`, only those scraped then too."""
        return sum(1 for key in self.targets if key[0] == component and (since is None or key in since.targets))


def parse_metrics(text: str) -> dict[str, float]:
    """The series the planner reads, summed over their labels (model, slo_class, ...); refusals only for lack of
    capacity (not a tenant over its rate, or a request over a cap)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REFUSED and sample.labels.get("reason") not in CAPACITY_REFUSALS:
                continue
            if sample.name in SCRAPED:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def counter_delta(before: Mapping[str, float] | None, after: Mapping[str, float], series: str) -> float:
    """Growth of a counter on one pod; a pod seen for the first time is a baseline (0), and a counter that
    went down was reset by a restart, so all of its current value is new."""
    if before is None:
        return 0.0
    now, then = after.get(series, 0.0), before.get(series, 0.0)
    return now - then if now >= then else now


def window_from_samples(before: Sample, after: Sample, spec: LLMDeploymentSpec) -> MetricsWindow | None:
    """Arrival rate, mean lengths, per-replica capacity and backlog between two scrapes (None: no time
    passed). A pool's capacity is its measured throughput per replica while it is saturated, else the
    spec's `tokensPerSecond`; ValueError when a pool has neither."""
    elapsed = after.at_s - before.at_s
    if elapsed <= 0:
        return None

    def total(component: str, series: str) -> float:
        return sum(counter_delta(before.targets.get(key), values, series)
                   for key, values in after.targets.items() if key[0] == component)

    def gauge(component: str, series: str) -> float:
        return sum(values.get(series, 0.0) for key, values in after.targets.items() if key[0] == component)

    requests = total("router", REQUESTS)
    # Demand is what arrived, served or not: a fleet that refuses for lack of capacity (429s, 503s), fails
    # requests, or is so slow that clients give up would otherwise look as loaded as what it managed to answer.
    # (A client's retries of a refused request count again: an overestimate while refusing, which errs towards
    # scaling up.)
    arrivals = requests + total("router", FAILED) + total("router", ABANDONED) + total("router", REFUSED)
    # Every request ends on a decode worker (short prompts skip the prefill pool): its counters see them all. Its
    # lengths are counted over the requests the same pods finished: a pod new since the last scrape is only a
    # baseline, and the requests it served are not in its tokens (nor, below, it in the replicas measured).
    finished = total("decode", FINISHED)
    mean_in = total("decode", PROMPT_TOKENS) / finished if finished > 0 else 0.0
    mean_out = total("decode", GENERATION_TOKENS) / finished if finished > 0 else 0.0
    capacities = []
    for pool, series in (("prefill", COMPUTED_PROMPT_TOKENS), ("decode", GENERATION_TOKENS)):
        pods = after.pods(pool, since=before)
        measured = total(pool, series) / elapsed / pods if pods else 0.0
        # Throughput says what a replica can do only while it is saturated (work waits in its queue); an
        # idle replica's throughput is just the load, and planning with it would scale up without end.
        saturated = gauge(pool, WAITING) > 0 and measured > 0
        capacity = measured if saturated else getattr(spec.scaling, pool).tokens_per_second
        if not capacity:
            raise ValueError(f"no {pool} capacity to plan with: set spec.scaling.{pool}.tokensPerSecond "
                             "(one replica's tokens/s, e.g. from `tandem plan`)")
        capacities.append(capacity)
    return MetricsWindow(
        end_s=after.at_s, arrival_rps=arrivals / elapsed, mean_input_tokens=mean_in, mean_output_tokens=mean_out,
        prefill_tok_s_per_replica=capacities[0], decode_tok_s_per_replica=capacities[1],
        prefill_backlog_tokens=gauge("prefill", WAITING) * mean_in,
        decode_backlog_tokens=gauge("decode", WAITING) * mean_out)


def fetch_text(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (pod IPs from EndpointSlices)
        return response.read().decode()


def slice_targets(endpoint_slice: Mapping[str, Any]) -> list[str]:
    """host:port of every ready endpoint in one EndpointSlice."""
    port = next((p.get("port") for p in endpoint_slice.get("ports") or [] if p.get("name") == "http"),
                names.HTTP_PORT)
    targets = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False or not endpoint.get("addresses"):
            continue
        host = endpoint["addresses"][0]
        targets.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return targets


class ScrapedMetrics:
    """`source(body) -> MetricsWindow | None` for the planner: None on the first tick of a deployment (one
    sample is no window), then the window since the previous tick. The last sample lives in memory: after an
    operator restart the first tick only takes a new baseline."""

    def __init__(self, kube: Kube, fetch: Callable[[str, float], str] = fetch_text,
                 clock: Callable[[], float] = time.monotonic, timeout_s: float = 2.0):
        self.kube, self.fetch, self.clock, self.timeout_s = kube, fetch, clock, timeout_s
        self._last: dict[str, Sample] = {}
        self._guard = threading.Lock()

    def sample(self, namespace: str, name: str) -> Sample:
        targets: dict[tuple[str, str], Mapping[str, float]] = {}
        missed = 0
        for component in names.COMPONENTS:
            selector = {"kubernetes.io/service-name": names.object_name(name, component)}
            for endpoint_slice in self.kube.list("discovery.k8s.io/v1", "EndpointSlice", namespace, selector):
                for address in slice_targets(endpoint_slice):
                    try:
                        targets[(component, address)] = parse_metrics(
                            self.fetch(f"http://{address}/metrics", self.timeout_s))
                    except (OSError, ValueError) as exc:  # one unreachable pod must not stop the other scrapes
                        missed += 1
                        log.warning("scraping %s pod %s of %s/%s failed: %s", component, address, namespace,
                                    name, exc)
        return Sample(at_s=self.clock(), targets=targets, missed=missed)

    def __call__(self, body: Mapping[str, Any]) -> MetricsWindow | None:
        meta = body["metadata"]
        spec = LLMDeploymentSpec.model_validate(body.get("spec") or {})
        after = self.sample(meta["namespace"], meta["name"])
        if after.missed:
            # A pod that could not be read counts no requests and no tokens: the window would show less load
            # than there is (none at all when nothing can be read, e.g. a NetworkPolicy in the way), and the
            # pools would be sized down for it. No window: the planner keeps the sizes it has.
            log.warning("%s/%s: %d pod(s) not scraped; holding the pool sizes this tick", meta["namespace"],
                        meta["name"], after.missed)
            return None
        with self._guard:
            before = self._last.get(meta["uid"])
            self._last[meta["uid"]] = after
        return None if before is None else window_from_samples(before, after, spec)
