"""Every Prometheus metric Tandem exports, named in one place (ARCHITECTURE.md §3).

All names carry the `tandem_` prefix and the labels `model` and `pool`
(prefill | decode | both | router); `slo_class` is added where it applies. Dashboards and
tests import the names from here, so a renamed metric cannot silently break a panel. A worker's
load and token counts are also exported under vLLM's names (VLLMNames), for the tools that query those.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# The *_created series double every counter's cardinality and no dashboard reads them.
disable_created_metrics()

# Latency buckets in seconds: fine at the low end where TTFT/ITL SLOs live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# Garbage-collection pauses: tens of microseconds for the youngest generation, up to milliseconds for a full one.
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

ENGINE_LABELS = ("model", "pool")


def gc_pauses(name: str, held: str, labels: dict, registry: CollectorRegistry) -> list:
    """One histogram child per collector generation (0, 1, 2), which tandem.server.heap observes every collection in."""
    histogram = Histogram(name, f"Time one garbage collection held {held}, by generation", (*labels, "generation"),
                          buckets=GC_PAUSE_BUCKETS, registry=registry)
    return [histogram.labels(**labels, generation=str(g)) for g in range(3)]


class EngineMetrics:
    """The engine's metrics, bound to one registry and one (model, pool) label pair.

    Attributes are the labelled children, ready to `.inc()`, `.set()` or `.observe()`.
    """

    def __init__(self, model: str, pool: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        labels = {"model": model, "pool": pool}

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ENGINE_LABELS, buckets=LATENCY_BUCKETS, registry=r).labels(**labels)

        self.ttft = hist("tandem_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("tandem_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("tandem_e2e_request_latency_seconds", "Arrival to last token")
        self.queue_time = hist("tandem_request_queue_time_seconds", "Arrival to first scheduled")
        self.running = Gauge("tandem_num_requests_running", "Requests being computed", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.waiting = Gauge("tandem_num_requests_waiting", "Requests queued", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.kv_blocks_used = Gauge("tandem_kv_blocks_used", "KV blocks held by requests", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.kv_blocks_total = Gauge("tandem_kv_blocks_total", "KV blocks in the cache", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.prefix_queried = Counter("tandem_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                      ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.prefix_hit = Counter("tandem_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.preemptions = Counter("tandem_preemptions", "Requests preempted (recomputed later)", ENGINE_LABELS,
                                   registry=r).labels(**labels)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens received", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.computed_prompt_tokens = Counter("tandem_computed_prompt_tokens",
                                              "Prompt tokens run through the model (not cached)", ENGINE_LABELS,
                                              registry=r).labels(**labels)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", ENGINE_LABELS,
                             registry=r).labels(**labels)
        self.requests_finished = Counter("tandem_requests_finished", "Requests finished, by reason",
                                         (*ENGINE_LABELS, "finish_reason"), registry=r)
        # KV transfer (P/D): the decode side pulls, the prefill side pins blocks under leases.
        self.kv_transfer_bytes = Counter("tandem_kv_transfer_bytes", "KV bytes pulled from prefill workers",
                                         ENGINE_LABELS, registry=r).labels(**labels)
        self.kv_transfer_blocks = Counter("tandem_kv_transfer_blocks", "KV blocks pulled from prefill workers",
                                          ENGINE_LABELS, registry=r).labels(**labels)
        self.kv_transfer_latency = hist("tandem_kv_transfer_seconds", "Duration of one KV pull")
        self.kv_transfer_fallbacks = Counter("tandem_kv_transfer_fallbacks",
                                             "Requests whose KV pull failed and were recomputed locally, by reason",
                                             (*ENGINE_LABELS, "reason"), registry=r)
        self.kv_pinned_blocks = Gauge("tandem_kv_pinned_blocks", "Blocks held under a lease for a decode worker",
                                      ENGINE_LABELS, registry=r).labels(**labels)
        self.kv_lease_expirations = Counter("tandem_kv_lease_expirations", "Leases that ran out before release",
                                            ENGINE_LABELS, registry=r).labels(**labels)
        self.gc_pauses = gc_pauses("tandem_gc_pause_seconds", "the worker (event loop and engine thread)", labels, r)
        # Speculative decoding (vLLM's spec_decode_* counters).
        self.spec_decode_num_drafts = Counter("tandem_spec_decode_num_drafts", "Drafts verified",
                                              ENGINE_LABELS, registry=r).labels(**labels)
        self.spec_decode_num_draft_tokens = Counter("tandem_spec_decode_num_draft_tokens", "Tokens drafted",
                                                    ENGINE_LABELS, registry=r).labels(**labels)
        self.spec_decode_num_accepted_tokens = Counter("tandem_spec_decode_num_accepted_tokens",
                                                       "Drafted tokens accepted", ENGINE_LABELS,
                                                       registry=r).labels(**labels)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position in the draft",
            (*ENGINE_LABELS, "position"), registry=r)
        self.spec_decode_num_skipped_steps = Counter(
            "tandem_spec_decode_num_skipped_steps", "Steps whose drafts were all dropped as not worth verifying",
            ENGINE_LABELS, registry=r).labels(**labels)
        self.spec_decode_mean_k = Gauge("tandem_spec_decode_mean_k",
                                        "Drafted tokens verified per decoding sequence, latest step",
                                        ENGINE_LABELS, registry=r).labels(**labels)
        self.labels = labels
        r.register(VLLMNames(self))

    def fallback(self, reason: str) -> None:
        self.kv_transfer_fallbacks.labels(**self.labels, reason=reason).inc()

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(**self.labels, finish_reason=reason).inc()

    def spec_decode_accepted_at(self, position: int):
        return self.spec_decode_num_accepted_tokens_per_pos.labels(**self.labels, position=str(position))


ROUTER_LABELS = ("model", "pool")


class RouterMetrics:
    """The router's metrics (pool="router"). Per-SLO-class and per-worker series carry extra labels."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.labels = {"model": model, "pool": "router"}
        self._children: dict[tuple, object] = {}
        by_class = (*ROUTER_LABELS, "slo_class")

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, by_class, buckets=LATENCY_BUCKETS, registry=r)

        def class_counter(name: str, doc: str) -> Counter:
            return Counter(name, f"{doc}, by SLO class", by_class, registry=r)

        self.ttft = hist("tandem_router_time_to_first_token_seconds", "Client-seen time to first token")
        self.itl = hist("tandem_router_inter_token_latency_seconds", "Client-seen time between tokens")
        self.e2e = hist("tandem_router_e2e_request_latency_seconds", "Client-seen request latency")
        # How each admitted request ended, by SLO class.
        self.requests = class_counter("tandem_router_requests", "Requests answered in full")
        self.failed = class_counter("tandem_router_failed_requests",
                                    "Requests admitted whose answer failed (every worker tried failed)")
        self.abandoned = class_counter("tandem_router_abandoned_requests",
                                       "Requests admitted whose client left before the answer was complete")
        self.goodput = class_counter("tandem_router_goodput_requests", "Requests that met their TTFT and ITL targets")
        self.slo_violations = Counter("tandem_router_slo_violations", "Requests answered in full that missed a "
                                      "target (kind ttft or itl: the worst inter-token latency)", (*by_class, "kind"),
                                      registry=r)
        self.rejections = Counter("tandem_router_rejections", "Requests refused, by reason",
                                  (*by_class, "reason"), registry=r)
        self.queue_depth = Gauge("tandem_router_queue_depth", "Requests admitted but not yet dispatched",
                                 by_class, registry=r)
        self.in_flight = Gauge("tandem_router_worker_in_flight", "Requests in flight per worker",
                               (*ROUTER_LABELS, "worker", "role"), registry=r)
        self.routing = Counter("tandem_router_routing_decisions", "Dispatch decisions by path",
                               (*ROUTER_LABELS, "path"), registry=r)  # disagg | colocated | fallback | migrated
        self.predicted_prefix_hit = Counter("tandem_router_predicted_prefix_hit_tokens",
                                            "Prompt tokens the router expected the chosen worker to have cached",
                                            ROUTER_LABELS, registry=r)
        self.engine_prefix_hit = Counter("tandem_router_engine_prefix_hit_tokens",
                                         "Prompt tokens the workers reported as prefix-cache hits",
                                         ROUTER_LABELS, registry=r)
        self.worker_healthy = Gauge("tandem_router_worker_healthy", "1 when the worker is in rotation",
                                    (*ROUTER_LABELS, "worker", "role"), registry=r)
        self.ejections = Counter("tandem_router_worker_ejections", "Times a worker was taken out of rotation for "
                                 "failing requests in a row", (*ROUTER_LABELS, "worker", "role"), registry=r)
        # A collection holds the GIL, and so the event loop and every request, whichever thread it runs in.
        self.gc_pauses = gc_pauses("tandem_router_gc_pause_seconds", "the router's event loop", self.labels, r)
        self.overload_diversions = Counter("tandem_router_overload_diversions",
                                           "Requests sent off their prefix key's worker because it was overloaded",
                                           (*ROUTER_LABELS, "role"), registry=r)

    def by_class(self, metric, slo_class: str, **extra):
        return self.plain(metric, slo_class=slo_class, **extra)

    def forget_worker(self, url: str, role: str) -> None:
        """Drop the series of a worker discovery no longer lists: pods come and go (scaling, restarts, rollouts),
        and every scrape, and the dashboards' per-worker panels, would otherwise keep them all."""
        for metric in (self.in_flight, self.worker_healthy, self.ejections):
            if self._children.pop((metric, ("worker", url), ("role", role)), None) is not None:
                metric.remove(*self.labels.values(), url, role)

    def plain(self, metric, **extra):
        # labels() validates and joins its arguments on every call, several times a request on the router's hot
        # path; a labelled child is a fixed object, so each is looked up once (and dropped by forget_worker).
        key = (metric, *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child


def all_metric_names() -> set[str]:
    """Every exported sample-name prefix (dashboard expressions may only use these)."""
    registry = CollectorRegistry()
    EngineMetrics("m", "both", registry)
    RouterMetrics("m", registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    for family in registry.collect():  # labelled families with no child yet emit no samples: derive names
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


class VLLMNames(Collector):
    """A worker's load under vLLM's metric names and label (`vllm:num_requests_waiting{model_name=...}`, ...), read
    from the tandem_ series when /metrics is scraped: what KEDA rules, the Gateway API Inference Extension's endpoint
    picker and vLLM dashboards already query. Only the load, token and speculative decoding counts; the rest keep
    their tandem_ names."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        m, model = self.metrics, self.metrics.labels["model"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, child) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], _value(child))
            return family

        total = _value(m.kv_blocks_total)
        yield gauge("vllm:num_requests_running", "Requests being computed (tandem_num_requests_running)",
                    _value(m.running))
        yield gauge("vllm:num_requests_waiting", "Requests queued (tandem_num_requests_waiting)", _value(m.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use, 0 to 1",
                    _value(m.kv_blocks_used) / total if total else 0.0)
        yield counter("vllm:prompt_tokens", "Prompt tokens received (tandem_prompt_tokens)", m.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated (tandem_generation_tokens)", m.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m.prefix_queried)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m.prefix_hit)
        yield counter("vllm:spec_decode_num_drafts", "Drafts verified", m.spec_decode_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted", m.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                      m.spec_decode_num_accepted_tokens)


def _value(child) -> float:
    return child._value.get()  # prometheus_client keeps no public getter on a child
