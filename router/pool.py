"""One pool of workers (prefill or decode) as the router sees it: membership, health, load.

Probes, ejection after failed requests, the hold-out of a worker that keeps failing, and failing the requests of
a silent worker: docs/design/routing.md ("Worker health").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tandem.config import EngineConfig
from tandem.metrics import RouterMetrics
from tandem.router.policies.p2c import DecodeWorkerState
from tandem.router.policies.ring import HashRing
from tandem.step_cost import StepCost

log = logging.getLogger(__name__)

RETURN_PROBE_S = 0.25  # while requests wait for a worker to return, how often the absent ones are probed
MAX_HOLD_OUT_S = 60.0  # the longest a failing worker is held out of rotation after an ejection
# The engine's defaults, for a worker that does not report its limits.
DEFAULT_MAX_NUM_SEQS = EngineConfig.model_fields["max_num_seqs"].default
DEFAULT_MAX_NUM_BATCHED_TOKENS = EngineConfig.model_fields["max_num_batched_tokens"].default


@dataclass
class Worker:
    url: str
    healthy: bool = False
    failures: int = 0
    in_flight: int = 0  # requests this router has on it
    prefill_tokens_in_flight: int = 0  # uncached prompt tokens dispatched, not yet prefilled
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0  # sequences running and waiting on it, as last reported
    in_flight_at_report: int = 0  # this router's in_flight when that report came: the rest of `running` is others'
    max_model_len: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # its engine's batch limit, as reported (else the engine's default)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # its per-step token budget, likewise
    context_tokens: int = 0  # the tokens of its running sequences' contexts, as reported
    step_cost: StepCost | None = None  # its step cost model, as reported (tandem.step_cost; None: not reported)
    step_tail: float = 1.0  # how much longer than predicted its steps' gaps run at worst (tandem.step_cost.StepTail)
    kv_pull_s: float = 0.0  # its KV pulls' mean time
    lora_adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves, as reported
    silent_probes: int = 0  # probes in a row that got no answer at all
    silence_reported: bool = False  # on_silent was called for this silence
    misplaced: bool = False  # its role is not its pool's (a decode worker listed as a prefill one)
    ejections: int = 0  # ejections for failures since it last served a request
    held_out_until: float = 0.0  # no probe takes it back before then (loop time)
    entered: int = 0  # the pool's count of entries into rotation when this worker last entered (0: never)
    prefills: int = 0  # prefills this router has on it now
    shared_time: float = 0.0  # the integral of dt / prefills over the time it had any: see prefill_started
    shared_time_at: float = 0.0  # when shared_time was last brought up to date

    @property
    def sequences_held(self) -> int:
        """Its decode load: the last report is up to one probe interval old, so this router's own in-flight
        requests count when they are more."""
        return max(self.running, self.in_flight)

    def prefill_started(self, now: float) -> float:
        """Counts a prefill dispatched to the worker; returns the mark prefill_done measures it from.

        A prefill is charged the worker's time as processor sharing divides it: while n of ours are in flight
        there, each is charged 1/n of every second. Prefills batched into one engine step so share that step, and
        the tokens charged per second add up to the worker's throughput at that load; the charges of all prefills
        add up to the time the worker was busy with them. Timing each request from its dispatch instead counts
        the others' share as its own: a rate that falls with the concurrency it is measured at, which admission
        (Little's law) then divides the in-flight work by again, predicting a TTFT about `concurrency` times too
        long."""
        self._share_time(now)
        self.prefills += 1
        return self.shared_time

    def prefill_done(self, now: float, mark: float) -> float:
        """Ends a prefill counted by prefill_started (whatever its outcome); returns the seconds it is charged."""
        self._share_time(now)
        self.prefills -= 1
        return self.shared_time - mark

    def _share_time(self, now: float) -> None:
        if self.prefills:
            self.shared_time += max(0.0, now - self.shared_time_at) / self.prefills
        self.shared_time_at = now


class WorkerPool:
    def __init__(self, role: str, http: httpx.AsyncClient, metrics: RouterMetrics, eject_after: int = 3,
                 silent_after: int = 2, on_silent: Callable[[str], None] | None = None):
        self.role = role
        self.http = http
        self.metrics = metrics
        self.eject_after = eject_after
        self.silent_after = silent_after
        self.on_silent = on_silent  # called with the URL once a worker's probes went unanswered silent_after times
        self.workers: dict[str, Worker] = {}
        self.ring = HashRing()  # healthy workers only
        self.entries = 0  # workers put into rotation so far
        self._entered = asyncio.Event()  # set (and replaced) whenever a worker enters rotation
        self._return_probe_at = float("-inf")  # loop time of the last probe round made by wait_for_entry

    # -- membership ----------------------------------------------------------------------
    def set_members(self, urls: list[str]) -> None:
        """Discovery's view of the pool; new workers join once a probe finds them ready."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.workers):
            if url not in wanted:
                self._set_healthy(self.workers.pop(url), False)
                self.metrics.forget_worker(url, self.role)
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
            self.entries += 1
            worker.entered = self.entries
            self.ring.add(worker.url)
            self._entered.set()
            self._entered = asyncio.Event()
        elif worker.url in self.ring:
            self.ring.remove(worker.url)
        self.metrics.plain(self.metrics.worker_healthy, worker=worker.url, role=self.role).set(int(healthy))
        log.info("%s worker %s is %s", self.role, worker.url, "in rotation" if healthy else "out of rotation")

    def leave_rotation(self, url: str, why: str) -> None:
        """Takes the worker out of rotation until a probe finds it ready again."""
        worker = self.workers.get(url.rstrip("/"))
        if worker is not None and worker.healthy:
            log.info("%s worker %s leaves rotation: %s", self.role, worker.url, why)
            self._set_healthy(worker, False)

    async def wait_for_entry(self, timeout_s: float) -> bool:
        """Wait until a worker enters rotation; False when none did within `timeout_s`.

        Whoever waits here holds a request with its prompt computed, so the workers out of rotation are probed
        every RETURN_PROBE_S meanwhile (one round per pool however many requests wait), not at the probe loop's
        interval: a restarted worker is taken back as soon as it is ready, not up to an interval later, when
        the wait may have run out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        entered = self._entered
        while not entered.is_set():
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(entered.wait(), min(RETURN_PROBE_S, left))
            except asyncio.TimeoutError:
                if loop.time() >= self._return_probe_at + RETURN_PROBE_S:
                    self._return_probe_at = loop.time()
                    absent = [w for w in self.workers.values() if not w.healthy]
                    await asyncio.gather(*(self.probe(w, RETURN_PROBE_S, counts_silence=False) for w in absent))
        return True

    # -- passive health ------------------------------------------------------------------
    def record_failure(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is None:
            return
        worker.failures += 1
        if worker.failures >= self.eject_after and worker.healthy:
            worker.ejections += 1
            hold = min(MAX_HOLD_OUT_S, 2.0 ** (worker.ejections - 1))
            worker.held_out_until = asyncio.get_running_loop().time() + hold
            self.metrics.plain(self.metrics.ejections, worker=url, role=self.role).inc()
            log.warning("%s worker %s failed %d requests in a row: out of rotation for at least %g s",
                        self.role, url, worker.failures, hold)
            self._set_healthy(worker, False)

    def record_success(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is not None:
            worker.failures = 0
            worker.ejections = 0

    # -- active health and load ------------------------------------------------------------
    async def probe(self, worker: Worker, timeout_s: float = 2.0, counts_silence: bool = True) -> None:
        """Reads the worker's load and readiness, and puts it in or out of rotation. Probes made more often than
        the probe loop's (counts_silence False) leave its count of unanswered probes alone: that count fails a
        silent worker's requests after `silent_after` rounds of the loop, not sooner."""
        silent = False
        try:
            r = await self.http.get(f"{worker.url}/internal/load", timeout=timeout_s)
            ok = r.status_code == 200
            if ok:
                load = r.json()
                worker.free_blocks, worker.total_blocks = load["free_blocks"], load["total_blocks"]
                worker.running = load["running"] + load["waiting"]
                worker.in_flight_at_report = worker.in_flight
                worker.max_model_len = load.get("max_model_len", 0)
                worker.max_num_seqs = int(load.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
                worker.max_num_batched_tokens = int(load.get("max_num_batched_tokens")
                                                    or DEFAULT_MAX_NUM_BATCHED_TOKENS)
                worker.context_tokens = int(load.get("context_tokens") or 0)
                cost = load.get("step_cost")
                worker.step_cost = None if cost is None else StepCost.from_dict(cost)
                worker.step_tail = max(1.0, float(load.get("step_tail") or 1.0))
                worker.kv_pull_s = max(0.0, float(load.get("kv_pull_s") or 0.0))
                worker.lora_adapters = frozenset(load.get("lora_adapters") or ())
                ok = self._serves_this_pool(worker, load.get("role"))
            ready = ok and (await self.http.get(f"{worker.url}/ready", timeout=timeout_s)).status_code == 200
        except httpx.TransportError:  # no answer: refused, reset, or nothing within the timeout
            ready, silent = False, True
        except (httpx.HTTPError, ValueError, KeyError, TypeError):  # an answer not shaped as a load report
            ready = False
        if counts_silence or not silent:
            worker.silent_probes = worker.silent_probes + 1 if silent else 0
            worker.silence_reported = worker.silence_reported and silent
        # Held out after failing requests, unless nothing else of the pool is in rotation: then it is the best
        # there is, and holding it out would turn every request into a 503.
        held_out = asyncio.get_running_loop().time() < worker.held_out_until and any(
            w.healthy for w in self.workers.values() if w is not worker)
        self._set_healthy(worker, ready and not held_out)

    def _serves_this_pool(self, worker: Worker, role: str | None) -> bool:
        """Whether a worker's role serves this pool: one that does not would refuse every request sent to it
        (400), so it stays out of rotation, and the log says why once."""
        misplaced = role is not None and role not in (self.role, "both")
        if misplaced and not worker.misplaced:
            log.warning("%s is a %s worker, listed among the %s workers: it stays out of rotation", worker.url, role,
                        self.role)
        worker.misplaced = misplaced
        return not misplaced

    def report_silent(self) -> None:
        """on_silent, once per silence, for each worker whose last silent_after probes went unanswered."""
        if self.on_silent is None:
            return
        for worker in self.workers.values():
            if worker.silent_probes >= self.silent_after and not worker.silence_reported:
                worker.silence_reported = True
                if worker.in_flight:
                    log.warning("%s worker %s has not answered %d probes: failing the %d requests it still has",
                                self.role, worker.url, self.silent_after, worker.in_flight)
                else:  # most often one that stopped as asked, or was scaled away: nothing lost, nothing to warn of
                    log.info("%s worker %s has not answered %d probes", self.role, worker.url, self.silent_after)
                self.on_silent(worker.url)

    # -- placement inputs ------------------------------------------------------------------
    def prefill_loads(self) -> dict[str, float]:
        return {w.url: w.prefill_tokens_in_flight for w in self.healthy()}

    def decode_states(self, exclude: set[str] = frozenset()) -> list[DecodeWorkerState]:
        return [DecodeWorkerState(w.url, free_kv_blocks=max(w.free_blocks, 0), running_seqs=w.sequences_held,
                                  healthy=w.healthy)
                for w in self.workers.values() if w.url not in exclude]


async def probe_pools(pools: list[WorkerPool], timeout_s: float = 2.0) -> None:
    """One probe round over every worker of `pools`, then the silent ones' requests failed (report_silent).

    Silence is a worker's when another worker, of any pool, answered in the same round, or when this router's event
    loop kept time through the round. When none answered and the loop ran a timer late by half the timeout or more
    (a probe's answer may then have waited behind its own timeout), the likelier
    cause is this router, and failing every request in flight would not help them. Judged over all pools: a lone
    prefill worker that hangs is found by the decode pool answering beside it."""
    workers = [w for pool in pools for w in pool.workers.values()]
    lag = LoopLag()
    try:
        await asyncio.gather(*(pool.probe(w, timeout_s) for pool in pools for w in pool.workers.values()))
    finally:
        lag.stop()
    if all(w.silent_probes for w in workers) and lag.worst_s > timeout_s / 2:
        return
    for pool in pools:
        pool.report_silent()


class LoopLag:
    """How late the event loop ran a short timer, at worst, while it lived: a loop held up by this process (a
    long computation, a paused process) runs every timer late by as much."""

    TICK_S = 0.05

    def __init__(self):
        self.worst_s = 0.0
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.TICK_S
            await asyncio.sleep(self.TICK_S)
            self.worst_s = max(self.worst_s, loop.time() - due)

    def stop(self) -> None:
        self._task.cancel()
