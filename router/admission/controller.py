"""SLO-aware admission: refuse early what cannot be served in time, queue the rest earliest deadline first.

The router calls, per request:

    decision = controller.decide(AdmissionRequest(...))   # Admit (now queued) or Reject(reason, retry_after_s)
    ...
    ticket = controller.pop()            # when a prefill worker has room: the most urgent admitted request
    ...                                  # dispatch it; when its prefill finishes:
    controller.rates.record_prefill(computed_tokens, seconds)
    controller.release(ticket.request.request_id)   # also on failure or client disconnect, queued or not

`decide` checks, in this order, and the first failing check names the reason:
  input_too_long / max_tokens_too_large   the caps (retry_after_s None: retrying cannot help)
  rate_limited    the tenant's bucket cannot cover prompt + max_tokens tokens; retry when it will have refilled
  queue_full      the bounded queue is full; retry after about one queued request's prefill time (1 s before
                  any prefill rate is measured)
  slo_unmeetable  predicted wait + own prefill time > the class's TTFT target; retry when the backlog ahead
                  will have drained enough, at the measured rate, for the request to fit
  dispatch_slots  the same, where the wait is for one of the router's --max-in-flight dispatch slots (below),
                  not for the prefill pool: more workers would not have served it
Only an admitted request is charged to its tenant's bucket.

Predicted wait (Little's law for a work-conserving pool): the uncached prompt tokens already in flight plus
those queued ahead of this request in EDF order, divided by the pool's prefill rate (the measured
per-worker rate times `prefill_workers`). Counting only the queue ahead, not all of it, is what lets an
interactive request overtake a batch backlog instead of being refused because of it. The request's own
prefill runs on one worker, so its time is its uncached tokens over the per-worker rate. A prompt too long
to meet its target even on an idle pool is admitted when nothing is ahead of it rather than refused
forever; a request of several choices is judged as one (AdmissionRequest). Until a rate is
known (no measurement and no prior) nothing is refused for the prefill backlog.

Dispatch slots: a router dispatches at most --max-in-flight requests at once, and a slot is held until the last
token. With the slots taken by long streams, a request waits for one however idle the prefill pool is:
`slot_wait_s` (the Dispatcher's prediction, by Little's law on slot hold times) says how long, given the
requests queued ahead of it, and the larger of the two waits is the one that counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

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


# Not frozen: a frozen dataclass's __init__ sets every field through object.__setattr__, and admission builds an
# AdmissionRequest and an Admit for every request the router serves.
@dataclass(slots=True)
class AdmissionRequest:
    """What admission needs to know about a request, after tokenization.

    `uncached_prompt_tokens` is the router's estimate of the prompt tokens the prefill worker will have to
    compute (prompt minus the prefix it expects cached); None means all of them. `charge_tokens` is what the
    tenant's token bucket is charged; None means prompt + max_tokens (a request of several choices charges its
    first choice with the whole and the others nothing: tandem.router.app.serve). Such a request is judged as one,
    on its first choice: `request_prefill_tokens` there is the prefill of all its prompts (None: this choice's
    own), and `checks_ttft` False on the others, which are not refused for the predicted wait. Judged alone, they
    would be refused for the wait their own first choice adds (they queue behind it by design:
    tandem.openai_choices.staggered), on an idle pool too.
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
    predicted_wait_s: float | None  # None when nothing was known to wait for (no prefill rate, no slot wait)


@dataclass(frozen=True)
class Reject:
    reason: RejectReason
    retry_after_s: float | None  # None: retrying the same request cannot succeed, or there is no estimate
    message: str


class AdmissionController:
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
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, slo in slo_classes.items():
            if name != slo.name:
                raise ValueError(f"SLO class registered as {name!r} is named {slo.name!r}")
        for cap_name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
            if cap is not None and cap < 1:
                raise ValueError(f"{cap_name} must be >= 1 or None, got {cap}")
        self.slo_classes = dict(slo_classes)
        self.max_input_tokens = max_input_tokens
        self.max_output_tokens = max_output_tokens
        self.rate_limiter = rate_limiter if rate_limiter is not None else TenantRateLimiter(clock=clock)
        self.rates = rates if rates is not None else ServiceRates()
        self.prefill_workers = prefill_workers
        self.queue: EDFQueue[Admit] = EDFQueue(max_queue)
        self._in_flight: dict[str, int] = {}  # request id -> uncached prompt tokens, dispatched, not released
        self._in_flight_total = 0  # their sum, kept as they come and go: every admission reads it
        self._clock = clock
        # Seconds until a dispatch slot is free for a request with n admitted requests queued before it (set by
        # the Dispatcher; none to wait for without one).
        self.slot_wait_s: Callable[[int], float] = lambda queued_ahead: 0.0

    @property
    def prefill_workers(self) -> int:
        """Prefill workers serving in parallel; the router keeps it at the healthy prefill pool's size."""
        return self._prefill_workers

    @prefill_workers.setter
    def prefill_workers(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"prefill_workers must be >= 1, got {count}")
        self._prefill_workers = count

    @property
    def queued_tokens(self) -> int:
        return sum(t.request.prefill_tokens for t in self.queue)

    @property
    def in_flight_tokens(self) -> int:
        return self._in_flight_total

    def _worker_tps(self) -> float | None:
        rate = self.rates.prefill_tps
        return rate if rate is not None and rate > 0 else None

    def _waits(self, deadline_s: float, priority: int, rate: float | None) -> tuple[float | None, float]:
        """For a request with this deadline and priority: (seconds until the pool has served everything in flight
        and queued ahead of it, None without a prefill rate; seconds until a dispatch slot frees for it)."""
        ahead = list(self.queue.ahead_of(deadline_s, priority)) if len(self.queue) else []
        slot_wait = self.slot_wait_s(len(ahead))
        if rate is None:
            return None, slot_wait
        return (self.in_flight_tokens + sum(t.request.prefill_tokens for t in ahead)) / (rate * self.prefill_workers), \
            slot_wait

    def decide(self, request: AdmissionRequest) -> Admit | Reject:
        slo = self.slo_classes.get(request.slo_class)
        if slo is None:
            raise ValueError(f"unknown SLO class {request.slo_class!r}; known: {sorted(self.slo_classes)}")
        if request.request_id in self.queue or request.request_id in self._in_flight:
            raise ValueError(f"request id {request.request_id!r} is already admitted")

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
        prefill_wait, slot_wait = self._waits(deadline, slo.priority, rate)
        wait = _longer(prefill_wait, slot_wait)
        if wait is not None and request.checks_ttft:
            own_tokens = request.prefill_tokens if request.request_prefill_tokens is None \
                else request.request_prefill_tokens
            own = own_tokens / rate if rate is not None else 0.0
            allowed = max(0.0, slo.ttft_s - own)
            if wait > allowed:
                # The backlog ahead drains at one second of predicted wait per second.
                slots = slot_wait > (prefill_wait or 0.0)
                return Reject(RejectReason.DISPATCH_SLOTS if slots else RejectReason.SLO_UNMEETABLE, wait - allowed,
                              f"predicted time to first token {wait + own:.2f} s exceeds the {slo.name!r} "
                              f"target of {slo.ttft_s:g} s" + (" (the router's dispatch slots are all taken: "
                                                                "--max-in-flight)" if slots else ""))

        self.rate_limiter.consume(tenant, charge)
        ticket = Admit(request, tenant, slo, now, deadline, wait)
        self.queue.push(request.request_id, ticket, deadline, slo.priority)
        return ticket

    def queued(self, slo_class: str) -> int:
        """Requests of that SLO class admitted and not yet dispatched (read when /metrics is scraped)."""
        return sum(1 for ticket in self.queue if ticket.slo.name == slo_class)

    def pop(self) -> Admit | None:
        """The admitted request with the earliest deadline, now counted as in flight; None when none waits."""
        if not self.queue:
            return None
        ticket = self.queue.pop()
        self._in_flight[ticket.request.request_id] = ticket.request.prefill_tokens
        self._in_flight_total += ticket.request.prefill_tokens
        return ticket

    def release(self, request_id: str) -> bool:
        """Forget a request whose prefill finished or failed, or that was cancelled while queued or in
        flight; False when the id is not known (already released)."""
        tokens = self._in_flight.pop(request_id, None)
        if tokens is not None:
            self._in_flight_total -= tokens
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
