"""One pool of workers (prefill or decode) as the router sees it: membership, health, load.

Health is active and passive: a probe loop reads each worker's /internal/load (200 = ready) every
`interval` seconds, and every failed request counts against its worker; after `eject_after`
consecutive failures a worker leaves the hash ring until a probe succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from tandem.metrics import RouterMetrics
from tandem.router.policies.p2c import DecodeWorkerState
from tandem.router.policies.ring import HashRing

log = logging.getLogger(__name__)


@dataclass
class Worker:
    url: str
    healthy: bool = False
    failures: int = 0
    in_flight: int = 0  # requests this router has on it
    prefill_tokens_in_flight: int = 0  # uncached prompt tokens dispatched, not yet prefilled
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    max_model_len: int = 0


class WorkerPool:
    def __init__(self, role: str, http: httpx.AsyncClient, metrics: RouterMetrics, eject_after: int = 3):
        self.role = role
        self.http = http
        self.metrics = metrics
        self.eject_after = eject_after
        self.workers: dict[str, Worker] = {}
        self.ring = HashRing()  # healthy workers only

    # -- membership ----------------------------------------------------------------------
    def set_members(self, urls: list[str]) -> None:
        """Discovery's view of the pool; new workers join once a probe finds them ready."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.workers):
            if url not in wanted:
                self._set_healthy(self.workers.pop(url), False)
        for url in wanted - set(self.workers):
            worker = self.workers[url] = Worker(url)
            # Read when /metrics is scraped, not set twice per request on the hot path.
            self.metrics.plain(self.metrics.in_flight, worker=url, role=self.role).set_function(
                lambda w=worker: w.in_flight)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def _set_healthy(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        if healthy:
            worker.failures = 0
            self.ring.add(worker.url)
        elif worker.url in self.ring:
            self.ring.remove(worker.url)
        self.metrics.plain(self.metrics.worker_healthy, worker=worker.url, role=self.role).set(int(healthy))
        log.info("%s worker %s is %s", self.role, worker.url, "in rotation" if healthy else "out of rotation")

    # -- passive health ------------------------------------------------------------------
    def record_failure(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is None:
            return
        worker.failures += 1
        if worker.failures >= self.eject_after:
            self._set_healthy(worker, False)

    def record_success(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is not None:
            worker.failures = 0

    # -- active health and load ------------------------------------------------------------
    async def probe(self, worker: Worker, timeout_s: float = 2.0) -> None:
        try:
            r = await self.http.get(f"{worker.url}/internal/load", timeout=timeout_s)
            ok = r.status_code == 200
            if ok:
                load = r.json()
                worker.free_blocks, worker.total_blocks = load["free_blocks"], load["total_blocks"]
                worker.running = load["running"] + load["waiting"]
                worker.max_model_len = load.get("max_model_len", 0)
            ready = ok and (await self.http.get(f"{worker.url}/ready", timeout=timeout_s)).status_code == 200
        except (httpx.HTTPError, ValueError, KeyError):
            ready = False
        self._set_healthy(worker, ready)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    # -- placement inputs ------------------------------------------------------------------
    def prefill_loads(self) -> dict[str, float]:
        return {w.url: w.prefill_tokens_in_flight for w in self.healthy()}

    def decode_states(self, exclude: set[str] = frozenset()) -> list[DecodeWorkerState]:
        # Reports are up to one probe interval old: count this router's own in-flight requests too.
        return [DecodeWorkerState(w.url, free_kv_blocks=max(w.free_blocks, 0), running_seqs=max(w.running, w.in_flight),
                                  healthy=w.healthy)
                for w in self.workers.values() if w.url not in exclude]
