"""SLO-aware admission: refuse early what cannot be served in time, queue the rest earliest deadline first.

`decide` admits (queued) or rejects with a reason, `pop` gives the most urgent admitted request, `release` ends
it. The order of the checks, the formula and its inputs: docs/admission.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tandem.router.admission.edf_queue import EDFQueue
from tandem.router.admission.rates import ServiceRates
from tandem.router.admission.slo import DEFAULT_SLO_CLASSES, SLOClass
from tandem.router.admission.token_bucket import TenantRateLimiter


class RejectReason(str, Enum):
    INPUT_TOO_LONG = "input_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    RATE_LIMITED = "rate_limited"
    QUEUE_FULL = "queue_full"
    SLO_UNMEETABLE = "slo_unmeetable"
    DISPATCH_SLOTS = "dispatch_slots"
    DECODE_CAPACITY = "decode_capacity"


# Not frozen: a frozen dataclass's __init__ sets every field through object.__setattr__, and admission builds an
# AdmissionRequest and an Admit for every request the router serves.
@dataclass(slots=True)
class AdmissionRequest:
    """What admission needs to know about a request, after tokenization.

    `uncached_prompt_tokens` is the router's estimate of the prompt tokens the prefill worker will have to
    compute (prompt minus the prefix it expects cached); None means all of them. `charge_tokens` is what the
    tenant's token bucket is charged; None means prompt + max_tokens (a request of several choices charges its
    first choice with the whole and the others nothing: tandem.router.app.serve). Such a request is judged as one,
    on its first choice: `request_prefill_tokens` (and `request_prefill_s`) there is the prefill of all its prompts
    (None: this choice's own), and `checks_ttft` False on the others, which are not refused for the predicted wait.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    slo_class: str = "interactive"
    api_key: str | None = None
    uncached_prompt_tokens: int | None = None
    charge_tokens: int | None = None
    checks_ttft: bool = True
    request_prefill_tokens: int | None = None
    ignore_eos: bool = False  # it makes all its max_tokens
    pool: str = "prefill"  # the pool that computes its prompt: "prefill" (P/D) or "decode" (colocated)
    prefill_s: float | None = None  # its prefill's predicted seconds there (None: its tokens over the measured rate)
    request_prefill_s: float | None = None  # the whole request's, on its first choice (see request_prefill_tokens)

    def __post_init__(self):
        if self.prompt_tokens < 0:
            raise ValueError(f"{self.request_id}: prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.max_tokens < 0:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 0, got {self.max_tokens}")
        if self.uncached_prompt_tokens is not None and not 0 <= self.uncached_prompt_tokens <= self.prompt_tokens:
            raise ValueError(f"{self.request_id}: uncached_prompt_tokens must be in [0, prompt_tokens], "
                             f"got {self.uncached_prompt_tokens} of {self.prompt_tokens}")

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens if self.uncached_prompt_tokens is None else self.uncached_prompt_tokens

    @property
    def charge(self) -> int:
        return self.prompt_tokens + self.max_tokens if self.charge_tokens is None else self.charge_tokens


@dataclass(slots=True)
class Admit:
    """An admitted request, waiting in the queue until pop() hands it out."""

    request: AdmissionRequest
    tenant: str
    slo: SLOClass
    arrival_s: float
    deadline_s: float
    predicted_wait_s: float | None  # None when nothing was known to wait for (no prediction, no slot wait)
    predicted_ttft_s: float | None = None  # its wait and prefill as the models predict them, before the correction


@dataclass(frozen=True)
class Reject:
    reason: RejectReason
    retry_after_s: float | None  # None: retrying the same request cannot succeed, or there is no estimate
    message: str


class Capacity(Protocol):
    """What a request waits for besides the prefill pool: a dispatch slot (tandem.router.app.Dispatcher)."""

    def wait_s(self, request: AdmissionRequest, slo: SLOClass, queued_ahead: int) -> tuple[float, RejectReason]:
        """Seconds until a slot is free for the request with `queued_ahead` admitted requests before it (math.inf:
        never), and what the slot is short of (dispatch_slots or decode_capacity)."""
        ...


class _NoCapacityLimit:
    def wait_s(self, request: AdmissionRequest, slo: SLOClass, queued_ahead: int) -> tuple[float, RejectReason]:
        return 0.0, RejectReason.DISPATCH_SLOTS


POOLS = ("prefill", "decode")


class AdmissionController:
    """`headroom`: the share of each target kept for what predictions miss (0.1: a request is admitted when its
    predicted time to first token is within 90% of its target). `enabled` False admits whatever passes the caps,
    the token buckets and the queue's size (first come, first served: what benchmarks compare against)."""

    def __init__(
        self,
        *,
        slo_classes: Mapping[str, SLOClass] = DEFAULT_SLO_CLASSES,
        max_queue: int = 1024,
        max_input_tokens: int | None = None,
        max_output_tokens: int | None = None,
        rate_limiter: TenantRateLimiter | None = None,
        rates: ServiceRates | None = None,
        prefill_workers: int = 1,
        headroom: float = 0.0,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, slo in slo_classes.items():
            if name != slo.name:
                raise ValueError(f"SLO class registered as {name!r} is named {slo.name!r}")
        for cap_name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
            if cap is not None and cap < 1:
                raise ValueError(f"{cap_name} must be >= 1 or None, got {cap}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.slo_classes = dict(slo_classes)
        self.max_input_tokens = max_input_tokens
        self.max_output_tokens = max_output_tokens
        self.rate_limiter = rate_limiter if rate_limiter is not None else TenantRateLimiter(clock=clock)
        self.rates = rates if rates is not None else ServiceRates()
        self.headroom = headroom
        self.enabled = enabled
        self._workers = {pool: 1 for pool in POOLS}
        self.prefill_workers = prefill_workers
        self.queue: EDFQueue[Admit] = EDFQueue(max_queue)
        self._in_flight: dict[str, AdmissionRequest] = {}  # dispatched, prefill not yet done
        # Per pool, kept as requests come and go (every admission reads them): the predicted seconds of the prefills
        # in flight, and the uncached tokens of those without a prediction (counted at the measured rate).
        self._in_flight_s = dict.fromkeys(POOLS, 0.0)
        self._in_flight_predicted = dict.fromkeys(POOLS, 0)  # how many have a prediction
        self._in_flight_tokens = dict.fromkeys(POOLS, 0)
        self._clock = clock
        self.capacity: Capacity = _NoCapacityLimit()  # the router's Dispatcher sets itself here
        # Measured TTFT / predicted TTFT of recent requests: what the predictions miss (other work on the workers'
        # cores, the router's own time), applied to the next ones as their median (record_ttft).
        self._ttft_ratios: deque[float] = deque(maxlen=self.CORRECTION_WINDOW)
        self.ttft_correction = 1.0

    @property
    def prefill_workers(self) -> int:
        """Prefill workers serving in parallel; the router keeps it at the healthy prefill pool's size."""
        return self._workers["prefill"]

    @prefill_workers.setter
    def prefill_workers(self, count: int) -> None:
        self.set_workers("prefill", count)

    def set_workers(self, pool: str, count: int) -> None:
        """How many workers of `pool` compute prompts in parallel (the router keeps it at the healthy count)."""
        if count < 1:
            raise ValueError(f"{pool}_workers must be >= 1, got {count}")
        self._workers[pool] = count

    @property
    def queued_tokens(self) -> int:
        return sum(t.request.prefill_tokens for t in self.queue)

    @property
    def in_flight_tokens(self) -> int:
        """Uncached prompt tokens dispatched and not released, on every pool."""
        return sum(r.prefill_tokens for r in self._in_flight.values())

    def _worker_tps(self) -> float | None:
        rate = self.rates.prefill_tps
        return rate if rate is not None and rate > 0 else None

    def _prefill_wait(self, ahead: list[Admit], pool: str, rate: float | None) -> float | None:
        """Seconds until `pool` has computed the prompts in flight on it and queued for it ahead of a request; None
        when nothing tells (no prediction and no measured rate)."""
        seconds, tokens = self._in_flight_s[pool], self._in_flight_tokens[pool]
        predicted = self._in_flight_predicted[pool]
        for ticket in ahead:
            queued = ticket.request
            if queued.pool == pool:
                if queued.prefill_s is not None:
                    seconds += queued.prefill_s
                    predicted += 1
                else:
                    tokens += queued.prefill_tokens
        if rate is not None:
            seconds += tokens / rate
        elif not predicted:
            return None
        return seconds / self._workers[pool]

    def decide(self, request: AdmissionRequest) -> Admit | Reject:
        slo = self.slo_classes.get(request.slo_class)
        if slo is None:
            raise ValueError(f"unknown SLO class {request.slo_class!r}; known: {sorted(self.slo_classes)}")
        if request.request_id in self.queue or request.request_id in self._in_flight:
            raise ValueError(f"request id {request.request_id!r} is already admitted")
        if request.pool not in POOLS:
            raise ValueError(f"unknown pool {request.pool!r}; known: {POOLS}")

        if self.max_input_tokens is not None and request.prompt_tokens > self.max_input_tokens:
            return Reject(RejectReason.INPUT_TOO_LONG, None,
                          f"prompt has {request.prompt_tokens} tokens, the limit is {self.max_input_tokens}")
        if self.max_output_tokens is not None and request.max_tokens > self.max_output_tokens:
            return Reject(RejectReason.MAX_TOKENS_TOO_LARGE, None,
                          f"max_tokens is {request.max_tokens}, the limit is {self.max_output_tokens}")

        tenant = self.rate_limiter.tenant_for(request.api_key)
        charge = request.charge
        refill_wait = self.rate_limiter.wait_s(tenant, charge)
        if refill_wait > 0:
            return Reject(RejectReason.RATE_LIMITED, refill_wait,
                          f"tenant {tenant!r} is over its token rate; {charge} tokens available in {refill_wait:.2f} s")

        rate = self._worker_tps()
        if self.queue.full:
            retry = 1.0  # a guess while no prefill rate is measured: a client is told to come back, not when
            if rate is not None and self.queued_tokens > 0:
                retry = self.queued_tokens / len(self.queue) / (rate * self.prefill_workers)
            return Reject(RejectReason.QUEUE_FULL, retry, f"admission queue is full ({self.queue.max_size} requests)")

        now = self._clock()
        deadline = now + slo.ttft_s
        wait = predicted = None
        if self.enabled:
            ahead = list(self.queue.ahead_of(deadline, slo.priority)) if len(self.queue) else []
            prefill_wait = self._prefill_wait(ahead, request.pool, rate)
            slot_wait, slot_reason = self.capacity.wait_s(request, slo, len(ahead))
            own = self._own_prefill_s(request, rate)
            wait = _longer(prefill_wait, slot_wait)
            predicted = None if wait is None and not own else (wait or 0.0) + own  # as the models make it
            factor = self.ttft_correction
            prefill_wait = None if prefill_wait is None else prefill_wait * factor
            slot_wait = slot_wait * factor
            wait = _longer(prefill_wait, slot_wait)
            if request.checks_ttft:
                refusal = self._refusal(slo, own, factor, prefill_wait, slot_wait, slot_reason)
                if refusal is not None:
                    return refusal

        self.rate_limiter.consume(tenant, charge)
        ticket = Admit(request, tenant, slo, now, deadline, wait, predicted)
        self.queue.push(request.request_id, ticket, deadline, slo.priority)
        return ticket

    def _refusal(self, slo: SLOClass, own: float, factor: float, prefill_wait: float | None, slot_wait: float,
                 slot_reason: RejectReason) -> Reject | None:
        """The refusal of a request whose predicted time to first token (`own` prefill times the correction `factor`
        after the waits) passes its class's target; None to admit. A prompt refused for good (no Retry-After) is
        one whose own prefill alone, as the model predicts it, passes the target."""
        target = slo.ttft_s * (1 - self.headroom)
        if own > target:  # its own prefill alone, on an idle pool: retrying cannot help
            return Reject(RejectReason.SLO_UNMEETABLE, None,
                          f"predicted time to first token {own:.2f} s exceeds the {slo.name!r} target of "
                          f"{slo.ttft_s:g} s: the prompt alone takes that long to compute; use a class with a "
                          f"longer target")
        if math.isinf(slot_wait):
            return Reject(slot_reason, None, f"the {slo.name!r} inter-token target of {slo.itl_s:g} s cannot be met: "
                                             "no decode worker's steps are that short, even for this stream alone")
        own *= factor
        wait = _longer(prefill_wait, slot_wait) or 0.0
        allowed = target - own
        if wait <= allowed:
            return None
        # The backlog ahead drains at one second of predicted wait per second.
        slots = slot_wait > (prefill_wait or 0.0)
        reason = slot_reason if slots else RejectReason.SLO_UNMEETABLE
        why = {RejectReason.DISPATCH_SLOTS: " (the router's dispatch slots are all taken: --max-in-flight)",
               RejectReason.DECODE_CAPACITY: " (the decode pool holds all the streams it can at this class's "
                                             "inter-token target)"}.get(reason, "")
        return Reject(reason, wait - allowed, f"predicted time to first token {wait + own:.2f} s exceeds the "
                                              f"{slo.name!r} target of {slo.ttft_s:g} s{why}")

    def _own_prefill_s(self, request: AdmissionRequest, rate: float | None) -> float:
        """The request's own prefill time (all its prompts, for a request of several choices); 0 when unknown."""
        if request.request_prefill_s is not None:
            return request.request_prefill_s
        if request.request_prefill_tokens is None and request.prefill_s is not None:
            return request.prefill_s
        tokens = request.prefill_tokens if request.request_prefill_tokens is None else request.request_prefill_tokens
        return tokens / rate if rate is not None else 0.0

    CORRECTION_WINDOW = 64  # recent requests whose measured / predicted TTFT the correction is the median of
    MIN_CORRECTION_SAMPLES = 8  # fewer say nothing: the correction stays 1
    MIN_PREDICTED_S = 0.05  # shorter predictions are too short to measure against

    def record_ttft(self, ticket: Admit, measured_s: float) -> None:
        """A request's first token came `measured_s` after its arrival: ttft_correction becomes the median of the
        recent measured / predicted ratios, within [1, 4]: predictions are only ever made longer by it (one too long
        costs a refusal; one too short, a missed target). The median, so that a request slow for its own reasons (a
        grammar compiled first) does not move it."""
        predicted = ticket.predicted_ttft_s
        if predicted is None or not self.MIN_PREDICTED_S <= predicted < math.inf:
            return
        self._ttft_ratios.append(measured_s / predicted)
        if len(self._ttft_ratios) >= self.MIN_CORRECTION_SAMPLES:
            self.ttft_correction = min(4.0, max(1.0, statistics.median(self._ttft_ratios)))

    def queued(self, slo_class: str) -> int:
        """Requests of that SLO class admitted and not yet dispatched (read when /metrics is scraped)."""
        return sum(1 for ticket in self.queue if ticket.slo.name == slo_class)

    def pop(self) -> Admit | None:
        """The admitted request with the earliest deadline, now counted as in flight; None when none waits."""
        if not self.queue:
            return None
        ticket = self.queue.pop()
        request = ticket.request
        self._in_flight[request.request_id] = request
        if request.prefill_s is not None:
            self._in_flight_s[request.pool] += request.prefill_s
            self._in_flight_predicted[request.pool] += 1
        else:
            self._in_flight_tokens[request.pool] += request.prefill_tokens
        return ticket

    def release(self, request_id: str) -> bool:
        """Forget a request whose prefill finished or failed, or that was cancelled while queued or in
        flight; False when the id is not known (already released)."""
        request = self._in_flight.pop(request_id, None)
        if request is not None:
            if request.prefill_s is not None:
                self._in_flight_predicted[request.pool] -= 1
                self._in_flight_s[request.pool] -= request.prefill_s
                if not self._in_flight_predicted[request.pool]:
                    self._in_flight_s[request.pool] = 0.0  # no float residue once none is left
            else:
                self._in_flight_tokens[request.pool] -= request.prefill_tokens
            return True
        return self.queue.remove(request_id) is not None

    def withdraw(self, request_id: str) -> bool:
        """Take back a request admitted but not yet handed out, as if it had never been: out of the queue, its
        charge back in its tenant's bucket (a request of several choices whose last one was refused). False when
        it is not queued."""
        ticket = self.queue.remove(request_id)
        if ticket is None:
            return False
        self.refund(ticket)
        return True

    def refund(self, ticket: Admit, tokens: int | None = None) -> None:
        """Give the ticket's tenant back `tokens` of what admitting it charged, by default all of it (nothing was
        served for it)."""
        self.rate_limiter.refund(ticket.tenant, ticket.request.charge if tokens is None else tokens)


def _longer(prefill_wait: float | None, slot_wait: float) -> float | None:
    """The wait that binds: the longer of the two, None when neither is known (no rate, no slot to wait for)."""
    if prefill_wait is None:
        return slot_wait or None
    return max(prefill_wait, slot_wait)
