"""Builds and runs a router process: tokenizer, pools, discovery, admission, HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import uvicorn

from tandem.config import API_KEY_ENV, RouterConfig
from tandem.hashing import model_seed
from tandem.metrics import RouterMetrics
from tandem.model_source import default_served_name
from tandem.router.admission import (
    DEFAULT_SLO_CLASSES,
    AdmissionController,
    RateLimit,
    RejectReason,
    ServiceRates,
    SLOClass,
    TenantRateLimiter,
)
from tandem.router.admission.decode_capacity import DecodeCapacity
from tandem.router.app import build_app
from tandem.router.discovery import make_discovery
from tandem.router.dispatcher import Dispatcher
from tandem.router.orchestrator import Orchestrator
from tandem.router.pool import WorkerPool, probe_pools
from tandem.router.worker_client import WorkerClient
from tandem.server.graceful import GracefulServer
from tandem.server.heap import settle_heap
from tandem.server.internal_auth import internal_headers
from tandem.tokenizer import load_tokenizer

log = logging.getLogger("tandem.router")

DEFAULT_MAX_MODEL_LEN = 8192  # until a worker reports its own


def load_slo_classes(config_dir: str | None) -> dict[str, SLOClass]:
    """SLO classes from $TANDEM_CONFIG_DIR/slo-classes.json ([{name, ttftMs, itlMs}]) over the defaults."""
    classes = dict(DEFAULT_SLO_CLASSES)
    path = os.path.join(config_dir, "slo-classes.json") if config_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            for i, c in enumerate(json.load(f)):
                classes[c["name"]] = SLOClass(c["name"], c["ttftMs"] / 1000, c["itlMs"] / 1000, priority=len(classes) - i)
    return classes


@dataclass
class Tenants:
    rate_limiter: TenantRateLimiter
    slo_for_key: dict[str, str]
    api_keys: list[str]
    require_api_key: bool


def load_tenants(tenants_dir: str | None) -> Tenants:
    """$TANDEM_TENANTS_DIR/tenants.json: {"apiKeys": {key: tenant}, "limits": {tenant: {"tokensPerSecond",
    "burst"}}, "sloClasses": {key: class}, "requireApiKey": bool}. Without it every caller is the unlimited
    default tenant; without "requireApiKey": true, so is a caller who sends no key or an unknown one."""
    path = os.path.join(tenants_dir, "tenants.json") if tenants_dir else None
    if not path or not os.path.isfile(path):
        return Tenants(TenantRateLimiter(), {}, [], False)
    with open(path) as f:
        spec = json.load(f)
    limits = {t: RateLimit(v["tokensPerSecond"], v["burst"]) for t, v in spec.get("limits", {}).items()}
    keys = spec.get("apiKeys", {})
    if spec.get("requireApiKey") and not keys:
        raise SystemExit(f"{path}: requireApiKey is set but apiKeys lists no key")
    return Tenants(TenantRateLimiter(keys, limits), dict(spec.get("sloClasses", {})), list(keys),
                   bool(spec.get("requireApiKey")))


class Router:
    def __init__(self, config: RouterConfig, discovery=None):
        """`discovery`: where the workers are (tandem.router.discovery's interface); by default as `config` says."""
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        if self.tokenizer is None:
            raise SystemExit(f"{config.model} has no tokenizer; the router needs one to route by prefix")
        # Long prompts are tokenized here: the tokenizer releases the GIL (tandem.router.app.tokenize).
        self.tokenize_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="tokenize")
        self.served_name = config.served_model_name or default_served_name(config.model)
        self.max_model_len = DEFAULT_MAX_MODEL_LEN
        self.metrics = RouterMetrics(self.served_name)
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
                                      headers=internal_headers())
        self.prefill = WorkerPool("prefill", self.http, self.metrics, config.eject_after_failures)
        self.decode = WorkerPool("decode", self.http, self.metrics, config.eject_after_failures)
        tenants = load_tenants(os.environ.get("TANDEM_TENANTS_DIR"))
        self.slo_for_key = tenants.slo_for_key
        # The keys a /v1/* request must present one of, once any is required (none: the API is open); see
        # tandem.router.api_keys. A tenant's key is always one of them.
        required = [*config.api_key, *filter(None, [os.environ.get(API_KEY_ENV)])]
        self.api_keys = [*required, *tenants.api_keys] if required or tenants.require_api_key else []
        self.admission = AdmissionController(
            slo_classes=load_slo_classes(os.environ.get("TANDEM_CONFIG_DIR")), max_queue=config.max_queue,
            max_input_tokens=config.max_input_tokens, max_output_tokens=config.max_output_tokens,
            rate_limiter=tenants.rate_limiter, rates=ServiceRates(initial_prefill_tps=config.initial_prefill_tps),
            headroom=config.slo_headroom, enabled=config.admission == "slo")
        self.dispatcher = Dispatcher(self.admission, config.max_in_flight, self.metrics,
                                     DecodeCapacity(self.decode.healthy, config.block_size))
        for name in self.admission.slo_classes:
            # Counted when /metrics is scraped, not kept up per request.
            self.metrics.by_class(self.metrics.queue_depth, name).set_function(
                lambda name=name: self.admission.queued(name))
            for ended in (self.metrics.failed, self.metrics.abandoned):  # series at 0: dashboards add them up
                self.metrics.by_class(ended, name)
            for kind in ("ttft", "itl"):
                self.metrics.by_class(self.metrics.slo_violations, name, kind=kind)
            # Series at 0 too, so that the rejection panels show 0 rather than "no data" until a first refusal.
            for reason in (*(r.value for r in RejectReason), "no_workers", "worker_refused"):
                self.metrics.by_class(self.metrics.rejections, name, reason=reason)
        for role in ("prefill", "decode"):
            self.metrics.plain(self.metrics.overload_diversions, role=role)
        self.worker_client = WorkerClient(transport=config.worker_transport)  # the data path; httpx only probes
        self.worker_client.on_notice = self._worker_notice
        for pool in (self.prefill, self.decode):  # a worker that stops answering probes loses its requests' wait
            pool.on_silent = self.worker_client.drop
        self.orchestrator = Orchestrator(config, self.prefill, self.decode, self.worker_client, self.metrics,
                                         model_seed(self.served_name))
        self.discovery = discovery or make_discovery(config)
        self._probes: asyncio.Task | None = None  # run_probes, between start and close

    async def refresh(self) -> None:
        """One round of discovery and health probes; keeps admission's view of the pool size current."""
        prefill_urls, decode_urls = await self.discovery.members()
        self.prefill.set_members(prefill_urls)
        self.decode.set_members(decode_urls)
        await probe_pools([self.prefill, self.decode])
        self.admission.prefill_workers = max(1, len(self.prefill.healthy()) or len(self.decode.healthy()))
        self.admission.set_workers("decode", max(1, len(self.decode.healthy())))
        self.dispatcher.capacity_changed()
        # The least context a worker in rotation serves: a request may meet any of them (its prefill one, its
        # decode one, or another after a failure), and a worker's limit is what its KV cache holds when that is less.
        limits = [w.max_model_len for w in self.decode.healthy() + self.prefill.healthy() if w.max_model_len]
        if limits:
            self.max_model_len = min(limits)

    async def run_probes(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # discovery hiccups must never stop the loop
                log.exception("discovery/probe round failed")
            await asyncio.sleep(self.config.health_interval_s)

    def _worker_notice(self, url: str, notice: str) -> None:
        """A worker's notice on its channel: "draining" takes it out of rotation now, not at the next probe (which
        then finds its /ready 503 and keeps it out)."""
        if notice == "draining":
            for pool in (self.prefill, self.decode):
                pool.leave_rotation(url, "it is draining")

    async def start(self) -> None:
        """Before serving (on the loop that serves): a known pool from the first request, kept known by probes."""
        await self.refresh()
        self._probes = asyncio.get_running_loop().create_task(self.run_probes())

    async def close(self) -> None:
        """After serving: the probes stopped, the connections to workers and the tokenizer threads let go."""
        if self._probes is not None:
            self._probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probes
        await self.http.aclose()
        await self.worker_client.close()
        self.tokenize_pool.shutdown(wait=False)


class _Server(GracefulServer):
    def __init__(self, config: uvicorn.Config, router: Router):
        super().__init__(config)
        self.router = router

    async def startup(self, sockets=None):
        await self.router.start()
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"tandem router (model {self.router.served_name}, {len(self.router.prefill.workers)} prefill, "
                  f"{len(self.router.decode.workers)} decode) listening on http://{host}:{port}", flush=True)

    async def shutdown(self, sockets=None):
        await super().shutdown(sockets)  # the requests in flight finish meanwhile: probes still find hung workers
        await self.router.close()


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    router = Router(config)
    app = build_app(router)
    # proxy_headers off: the router reads no client address, so rewriting it from X-Forwarded-For (uvicorn's
    # default, a middleware pass per request) would buy nothing.
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                                    proxy_headers=False, timeout_graceful_shutdown=config.graceful_shutdown_s), router)
    # Objects built by now (tokenizer, chat template, metrics, the app) live as long as the process: frozen, and
    # the youngest generation collected per --gc-young-threshold net new objects (tandem.server.heap says why;
    # benchmarks/router.py measures the collections' share of the router's CPU at that and at CPython's 700).
    log.info(settle_heap(router.metrics.gc_pauses, config.gc_young_threshold))
    server.run()
    return 0
