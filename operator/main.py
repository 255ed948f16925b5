"""`tandem operator`: run the kopf operator that reconciles LLMDeployments.

High availability: start several replicas with `--peering NAME` (the Helm chart does this when
`operator.replicas > 1`). Kopf peering makes exactly one replica active; the others stand by and take
over when its heartbeat stops. Without `--peering` the operator runs standalone.
"""

from __future__ import annotations

import asyncio
import logging
import random

import kopf
import kubernetes.client
import kubernetes.config

from tandem.operator import names
from tandem.operator.crd import CRD_GROUP
from tandem.operator.handlers import WATCHED, build_registry
from tandem.operator.kube import Kube, load_api_client
from tandem.operator.metrics_source import ScrapedMetrics
from tandem.operator.planner import MetricsSource, Planner
from tandem.operator.reconcile import StatusKeeper

log = logging.getLogger("tandem.operator")


class QuietTimers(logging.Filter):
    """Drops kopf's line for every timer run that went through: the planner's and the retry's timers run every few
    seconds for every LLMDeployment, mostly to find nothing to do, and what they do is logged and posted by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Timer ") and message.endswith(" succeeded."))


def quiet_timers() -> None:
    objects = logging.getLogger("kopf.objects")  # the logger of kopf's per-object lines
    if not any(isinstance(f, QuietTimers) for f in objects.filters):
        objects.addFilter(QuietTimers())


def operator_settings(peering: str | None = None) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # The resources are known in advance: no CRD or namespace scanning, hence no cluster-wide RBAC for it.
    settings.scanning.disabled = True
    # kopf's bookkeeping goes to annotations under our group: status stays ours and schema-valid.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=CRD_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=CRD_GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{CRD_GROUP}/finalizer"
    settings.posting.reporting_component = names.MANAGER
    # kopf would post an Event for each of its own info lines (every handler run, every Deployment status
    # change); only its warnings and errors go out, and the operator posts one Event per action itself.
    settings.posting.level = logging.WARNING
    # The API server sends the operator only the objects it owns of the kinds it watches: not every Secret and
    # ConfigMap of the namespaces it serves (RBAC grants it list and watch on all of them).
    for _, _, plural in WATCHED:
        settings.watching.label_selectors[plural] = names.OWNED_SELECTOR
    settings.execution.max_workers = 8
    settings.networking.request_timeout = 60
    if peering:
        settings.peering.mandatory = True
    return settings


async def operate(namespace: str | None, *, api_client: kubernetes.client.ApiClient,
                  peering: str | None = None, priority: int = 0, liveness: str | None = None,
                  resync_seconds: float | None = 300.0, stop_flag: asyncio.Event | None = None,
                  ready_flag: asyncio.Event | None = None, metrics_source: MetricsSource | None = None,
                  planner_tick_seconds: float = 5.0) -> None:
    """The operator as a coroutine (tests run it next to an emulated API server in one event loop).

    `metrics_source` feeds planner mode (default: scrape the pods' /metrics); `planner_tick_seconds` is how
    often it checks whether a resource's `spec.scaling.intervalSeconds` has passed.
    """
    quiet_timers()
    kube = Kube(api_client)
    keeper = StatusKeeper(kube)
    planner = Planner(kube, keeper, metrics_source or ScrapedMetrics(kube), tick_s=planner_tick_seconds)
    registry = build_registry(kube, keeper, resync_seconds, planner)
    scope = f"namespace {namespace}" if namespace else "all namespaces"
    log.info("tandem operator reconciling LLMDeployments in %s via %s (%s%s)", scope, api_client.configuration.host,
             f"peering {peering!r}, priority {priority}" if peering else "standalone",
             f", liveness at {liveness}" if liveness else "")
    await kopf.operator(
        registry=registry, settings=operator_settings(peering), clusterwide=namespace is None,
        namespaces=[namespace] if namespace else (), standalone=peering is None, peering_name=peering,
        priority=priority, liveness_endpoint=liveness, stop_flag=stop_flag, ready_flag=ready_flag)


def peering_priority(requested: int | None) -> int:
    """kopf pauses every replica that sees a live peer of the same priority, so replicas started alike (the Helm
    chart's, with no --priority) would all stand by and none would reconcile. Unless one is given, each draws its
    own: the highest is active, the others take over by the same rule when its heartbeat stops."""
    return requested if requested is not None else random.SystemRandom().randrange(1, 2**31)


def run_operator(namespace: str | None, *, peering: str | None = None, priority: int | None = None,
                 liveness: str | None = None, kubeconfig: str | None = None, context: str | None = None,
                 resync_seconds: float | None = 300.0) -> int:
    """Run until SIGINT/SIGTERM (kopf stops its watches and lets running handlers finish)."""
    try:
        api_client = load_api_client(kubeconfig, context)
    except kubernetes.config.ConfigException as exc:
        raise SystemExit(f"tandem operator: no cluster credentials (not in a pod, and the kubeconfig "
                         f"{kubeconfig or '$KUBECONFIG or ~/.kube/config'} gave none): {exc}") from None
    asyncio.run(operate(namespace, api_client=api_client, peering=peering, priority=peering_priority(priority),
                        liveness=liveness, resync_seconds=resync_seconds))
    return 0
