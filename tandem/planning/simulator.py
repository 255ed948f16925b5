"""A discrete-event simulator of a prefill/decode fleet, to judge planner policies at fleet scale.

What it models, per request: arrival at the router; a FIFO wait for a free prefill worker; the prefill
(`ServiceModel.prefill_time`), at whose end the first token is out (TTFT); an optional KV transfer; a FIFO
wait for a decode slot; then decoding in a batch. A prefill worker runs one prefill at a time (throughput in
tokens/s is what matters for compute-bound prefill). A decode worker runs up to `max_batch` sequences by
processor sharing: with b sequences every one of them gains a token each `itl(b)` seconds, so each join or
leave changes the pace of all the others; the simulator tracks one "tokens done" clock per worker and the
sequences' finishing marks on it, so a batch change costs O(log b), not O(b). The router places a decode on
the less loaded of two random workers (power of two choices), falling back to any worker with a free slot.

The fleet: workers start (`startup_s`, paid for in GPU time from the moment they are asked for), serve, and
drain (a scaled-down worker takes no new work, finishes what it has, then goes). A policy is either static
(fixed pools) or the planner: every `tick_s` it hands the last window's measurements to
`tandem.planning.policy.recommend` and applies the answer.

Reported: SLO attainment (the share of requests with TTFT <= the TTFT SLO and mean inter-token time <= the
ITL SLO, where the mean inter-token time covers everything between the first and the last token, decode queue
and transfer included), latency percentiles, GPU-hours over the trace, and the peak and mean GPUs held.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tandem.planning.policy import FleetState, MetricsWindow, PlannerLimits, Recommendation, recommend
from tandem.planning.service_model import ServiceModel
from tandem.planning.workload import Trace

STARTING, ACTIVE, DRAINING, GONE = range(4)
_PREFILL_DONE, _DECODE_DONE, _DECODE_ARRIVE, _READY, _TICK = range(5)


@dataclass(frozen=True)
class SimConfig:
    model: ServiceModel
    slo_ttft_s: float
    slo_itl_s: float
    prefill_gpus_per_replica: int = 1  # one replica's tensor-parallel size
    decode_gpus_per_replica: int = 1
    startup_s: float = 180.0
    kv_transfer_s: float = 0.0
    tick_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        for name in ("slo_ttft_s", "slo_itl_s", "tick_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"simulator: {name} must be > 0, got {getattr(self, name)}")
        for name in ("startup_s", "kv_transfer_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"simulator: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_gpus_per_replica", "decode_gpus_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"simulator: {name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class StaticPolicy:
    """Fixed pools, e.g. sized for the peak."""

    prefill: int
    decode: int
    name: str = "static"


@dataclass(frozen=True)
class PlannerPolicy:
    """`recommend()` every tick, starting from `initial` (prefill, decode) replicas."""

    limits: PlannerLimits
    initial: tuple[int, int]
    name: str = "planner"


@dataclass
class SimResult:
    policy: str
    requests: int
    attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    gpu_hours: float
    peak_gpus: int
    mean_gpus: float
    scale_changes: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, prefill, decode) replicas
    reasons: list[tuple[float, str]] = field(default_factory=list)


class _Prefill:
    __slots__ = ("state", "busy")

    def __init__(self, state):
        self.state, self.busy = state, False


class _Decode:
    __slots__ = ("state", "b", "clock", "t", "itl", "marks", "version")

    def __init__(self, state):
        self.state, self.b, self.clock, self.t, self.itl, self.marks, self.version = state, 0, 0.0, 0.0, 0.0, [], 0


def simulate(trace: Trace, config: SimConfig, policy: StaticPolicy | PlannerPolicy) -> SimResult:
    """Run `trace` through a fleet governed by `policy`; see the module docstring."""
    return _Simulation(trace, config, policy).run()


class _Simulation:
    def __init__(self, trace: Trace, config: SimConfig, policy):
        if len(trace) == 0:
            raise ValueError("simulator: the trace has no requests")
        self.trace, self.cfg, self.policy = trace, config, policy
        self.model = config.model
        self.arrival = trace.arrival_s.astype(float)
        self.inp = trace.input_tokens.astype(np.int64).tolist()
        self.out = trace.output_tokens.astype(np.int64).tolist()
        self.duration = float(math.ceil(self.arrival[-1] / config.tick_s) * config.tick_s)
        n = len(trace)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.events: list = []
        self.seq = 0
        self.rng = random.Random(config.seed)
        self.now = 0.0
        # pools
        self.prefill_workers: list[_Prefill] = []
        self.decode_workers: list[_Decode] = []
        self.idle_prefill: list[_Prefill] = []
        self.active_decode: list[_Decode] = []
        self.decode_free_slots = 0
        self.prefill_queue: deque[int] = deque()
        self.decode_queue: deque[int] = deque()
        self.prefill_backlog = 0.0
        self.decode_backlog = 0.0
        # accounting
        self.gpu_seconds = 0.0
        self.accounted_to = 0.0
        self.peak_gpus = 0
        self.last_change: float | None = None
        self.scale_changes = 0
        self.timeline: list[tuple[float, int, int]] = []
        self.reasons: list[tuple[float, str]] = []
        self._reset_window()

    # -- event plumbing ---------------------------------------------------------------------------------

    def _push(self, when: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, a, b))

    def _reset_window(self) -> None:
        self.win_arrivals = 0
        self.win_in = 0
        self.win_out = 0
        self.win_prefill_tokens = 0.0
        self.win_prefill_busy = 0.0

    def _allocated(self, workers) -> int:
        return sum(1 for w in workers if w.state != GONE)

    def _gpus_held(self) -> int:
        return (self._allocated(self.prefill_workers) * self.cfg.prefill_gpus_per_replica
                + self._allocated(self.decode_workers) * self.cfg.decode_gpus_per_replica)

    def _account(self) -> None:
        """Add GPU time held since the last call (only inside the trace's duration)."""
        t = min(self.now, self.duration)
        if t > self.accounted_to:
            self.gpu_seconds += self._gpus_held() * (t - self.accounted_to)
            self.accounted_to = t

    def _note_gpus(self) -> None:
        self.peak_gpus = max(self.peak_gpus, self._gpus_held())

    # -- prefill --------------------------------------------------------------------------------------

    def _start_prefill(self, w: _Prefill, rid: int) -> None:
        w.busy = True
        tokens = self.inp[rid]
        duration = self.model.prefill_time(tokens)
        self.win_prefill_tokens += tokens
        self.win_prefill_busy += duration
        self._push(self.now + duration, _PREFILL_DONE, w, rid)

    def _prefill_next(self, w: _Prefill) -> None:
        if self.prefill_queue:
            rid = self.prefill_queue.popleft()
            self.prefill_backlog -= self.inp[rid]
            self._start_prefill(w, rid)
        else:
            self.idle_prefill.append(w)

    def _on_arrival(self, rid: int) -> None:
        self.win_arrivals += 1
        self.win_in += self.inp[rid]
        self.win_out += self.out[rid]
        while self.idle_prefill:
            w = self.idle_prefill.pop()
            if w.state == ACTIVE and not w.busy:
                self._start_prefill(w, rid)
                return
        self.prefill_queue.append(rid)
        self.prefill_backlog += self.inp[rid]

    def _on_prefill_done(self, w: _Prefill, rid: int) -> None:
        self.first_token[rid] = self.now
        w.busy = False
        if self.out[rid] <= 1:
            self.finish[rid] = self.now
        elif self.cfg.kv_transfer_s > 0:
            self._push(self.now + self.cfg.kv_transfer_s, _DECODE_ARRIVE, rid)
        else:
            self._on_decode_arrive(rid)
        if w.state == ACTIVE:
            self._prefill_next(w)
        elif w.state == DRAINING:
            self._account()
            w.state = GONE

    # -- decode ---------------------------------------------------------------------------------------

    def _advance(self, w: _Decode) -> None:
        if w.b:
            w.clock += (self.now - w.t) / w.itl
        w.t = self.now

    def _reschedule(self, w: _Decode) -> None:
        w.itl = self.model.itl(w.b)
        w.version += 1
        if w.marks:
            self._push(self.now + max(w.marks[0][0] - w.clock, 0.0) * w.itl, _DECODE_DONE, w, w.version)

    def _join(self, w: _Decode, rid: int) -> None:
        self._advance(w)
        w.b += 1
        self.decode_free_slots -= 1
        heapq.heappush(w.marks, (w.clock + self.out[rid] - 1, rid))
        self._reschedule(w)

    def _pick_decode(self) -> _Decode | None:
        if self.decode_free_slots <= 0:
            return None
        ws = self.active_decode
        a, b = ws[self.rng.randrange(len(ws))], ws[self.rng.randrange(len(ws))]
        w = a if a.b <= b.b else b
        if w.b < self.model.max_batch:
            return w
        return min((x for x in ws if x.b < self.model.max_batch), key=lambda x: x.b)

    def _on_decode_arrive(self, rid: int) -> None:
        w = self._pick_decode()
        if w is None:
            self.decode_queue.append(rid)
            self.decode_backlog += self.out[rid] - 1
        else:
            self._join(w, rid)

    def _fill_from_queue(self, w: _Decode) -> None:
        while self.decode_queue and w.b < self.model.max_batch:
            rid = self.decode_queue.popleft()
            self.decode_backlog -= self.out[rid] - 1
            self._join(w, rid)

    def _on_decode_done(self, w: _Decode, version: int) -> None:
        if version != w.version:
            return  # superseded by a batch change
        self._advance(w)
        marks = w.marks
        while marks and marks[0][0] <= w.clock + 1e-6:
            _, rid = heapq.heappop(marks)
            self.finish[rid] = self.now
            w.b -= 1
            if w.state == ACTIVE:
                self.decode_free_slots += 1
        if w.state == ACTIVE:
            self._fill_from_queue(w)
        elif w.state == DRAINING and w.b == 0:
            self._account()
            w.state = GONE
        self._reschedule(w)

    # -- fleet changes --------------------------------------------------------------------------------

    def _on_ready(self, w) -> None:
        if w.state != STARTING:
            return  # cancelled while starting
        w.state = ACTIVE
        if isinstance(w, _Prefill):
            self._prefill_next(w)
        else:
            w.t = self.now
            self.active_decode.append(w)
            self.decode_free_slots += self.model.max_batch - w.b
            self._fill_from_queue(w)

    def _live(self, workers) -> list:
        return [w for w in workers if w.state in (STARTING, ACTIVE)]

    def _resize(self, workers: list, target: int, make, decode: bool) -> None:
        live = self._live(workers)
        if target > len(live):
            for _ in range(target - len(live)):
                w = make(STARTING)
                workers.append(w)
                self._push(self.now + self.cfg.startup_s, _READY, w)
            return
        # Give back the cheapest first: workers still starting, then idle ones, then busy ones (drained).
        order = sorted(live, key=lambda w: (w.state == ACTIVE, (w.b if decode else w.busy)))
        for w in order[: len(live) - target]:
            was_active = w.state == ACTIVE
            busy = w.b > 0 if decode else w.busy
            w.state = DRAINING if (was_active and busy) else GONE
            if decode and was_active:
                self.active_decode.remove(w)
                self.decode_free_slots -= self.model.max_batch - w.b
        workers[:] = [w for w in workers if w.state != GONE]
        if not decode:
            self.idle_prefill = [w for w in self.idle_prefill if w.state == ACTIVE and not w.busy]

    def _apply(self, prefill: int, decode: int) -> None:
        self._account()
        self._resize(self.prefill_workers, prefill, _Prefill, decode=False)
        self._resize(self.decode_workers, decode, _Decode, decode=True)
        self._note_gpus()

    def _on_tick(self) -> None:
        live_p, live_d = len(self._live(self.prefill_workers)), len(self._live(self.decode_workers))
        if isinstance(self.policy, PlannerPolicy):
            window = MetricsWindow(
                end_s=self.now,
                arrival_rps=self.win_arrivals / self.cfg.tick_s,
                mean_input_tokens=self.win_in / self.win_arrivals if self.win_arrivals else 0.0,
                mean_output_tokens=self.win_out / self.win_arrivals if self.win_arrivals else 0.0,
                prefill_tok_s_per_replica=(self.win_prefill_tokens / self.win_prefill_busy
                                           if self.win_prefill_busy else self.model.prefill_tok_s),
                decode_tok_s_per_replica=self.model.decode_tok_s(),
                prefill_backlog_tokens=max(self.prefill_backlog, 0.0),
                decode_backlog_tokens=max(self.decode_backlog, 0.0),
            )
            current = FleetState(live_p, live_d, self.last_change)
            rec: Recommendation = recommend(window, current, self.policy.limits)
            if rec.changes(current):
                self._apply(rec.prefill, rec.decode)
                self.last_change = self.now
                self.scale_changes += 1
                self.reasons.append((self.now, rec.reason))
                live_p, live_d = rec.prefill, rec.decode
        self.timeline.append((self.now, live_p, live_d))
        self._reset_window()
        if self.now + self.cfg.tick_s <= self.duration:
            self._push(self.now + self.cfg.tick_s, _TICK, None)

    # -- main loop ------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        initial = (self.policy.prefill, self.policy.decode) if isinstance(self.policy, StaticPolicy) \
            else self.policy.initial
        if min(initial) < 1:
            raise ValueError(f"simulator: the initial fleet needs a worker in each pool, got {initial}")
        for _ in range(initial[0]):
            w = _Prefill(ACTIVE)
            self.prefill_workers.append(w)
            self.idle_prefill.append(w)
        for _ in range(initial[1]):
            w = _Decode(ACTIVE)
            self.decode_workers.append(w)
            self.active_decode.append(w)
            self.decode_free_slots += self.model.max_batch
        self._note_gpus()
        self._push(self.cfg.tick_s, _TICK, None)

        arrival, n, events = self.arrival, len(self.arrival), self.events
        handlers = {_PREFILL_DONE: self._on_prefill_done, _DECODE_DONE: self._on_decode_done,
                    _DECODE_ARRIVE: lambda rid, _: self._on_decode_arrive(rid),
                    _READY: lambda w, _: self._on_ready(w), _TICK: lambda *_: self._on_tick()}
        i = 0
        while i < n or events:
            if i < n and (not events or arrival[i] <= events[0][0]):
                self.now = arrival[i]
                self._on_arrival(i)
                i += 1
                continue
            when, _, kind, a, b = heapq.heappop(events)
            self.now = when
            handlers[kind](a, b)
        self._account()
        return self._result()

    def _result(self) -> SimResult:
        out = np.asarray(self.out)
        ttft = self.first_token - self.arrival
        tpot = np.where(out > 1, (self.finish - self.first_token) / np.maximum(out - 1, 1), 0.0)
        ok = (ttft <= self.cfg.slo_ttft_s) & (tpot <= self.cfg.slo_itl_s)
        hours = self.duration / 3600.0
        return SimResult(
            policy=self.policy.name,
            requests=len(ttft),
            attainment=float(ok.mean()),
            ttft_p50_s=float(np.percentile(ttft, 50)),
            ttft_p99_s=float(np.percentile(ttft, 99)),
            tpot_p50_s=float(np.percentile(tpot[out > 1], 50)) if (out > 1).any() else 0.0,
            tpot_p99_s=float(np.percentile(tpot[out > 1], 99)) if (out > 1).any() else 0.0,
            gpu_hours=self.gpu_seconds / 3600.0,
            peak_gpus=self.peak_gpus,
            mean_gpus=self.gpu_seconds / 3600.0 / hours if hours else 0.0,
            scale_changes=self.scale_changes,
            timeline=self.timeline,
            reasons=self.reasons,
        )


def format_comparison(results: list[SimResult], slo_ttft_s: float, slo_itl_s: float) -> str:
    """A side-by-side table of simulation results, with GPU-hours relative to the first row."""
    head = (f"{'policy':<10} {'requests':>9} {'SLO attained':>12} {'TTFT p99':>9} {'TPOT p99':>9} "
            f"{'GPU-hours':>10} {'vs first':>8} {'peak GPUs':>9} {'mean GPUs':>9} {'changes':>7}")
    lines = [f"SLO: TTFT <= {slo_ttft_s:g} s and mean inter-token time <= {slo_itl_s * 1000:g} ms", head,
             "-" * len(head)]
    base = results[0].gpu_hours if results else 0
    for r in results:
        lines.append(f"{r.policy:<10} {r.requests:>9} {r.attainment * 100:>11.2f}% {r.ttft_p99_s:>8.3f}s "
                     f"{r.tpot_p99_s * 1000:>7.1f}ms {r.gpu_hours:>10.1f} {r.gpu_hours / base:>7.2f}x "
                     f"{r.peak_gpus:>9} {r.mean_gpus:>9.1f} {r.scale_changes:>7}")
    return "\n".join(lines)
