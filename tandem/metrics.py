"""Every Prometheus metric Tandem exports, named in one place (ARCHITECTURE.md §3).

All names carry the `tandem_` prefix and the labels `model` and `pool`
(prefill | decode | both | router); `slo_class` is added where it applies. Dashboards and
tests import the names from here, so a renamed metric cannot silently break a panel.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# The *_created series double every counter's cardinality and no dashboard reads them.
disable_created_metrics()

# Latency buckets in seconds: fine at the low end where TTFT/ITL SLOs live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

ENGINE_LABELS = ("model", "pool")


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
        self.labels = labels

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(**self.labels, finish_reason=reason).inc()
