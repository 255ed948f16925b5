"""Hands admitted requests to the pools in earliest-deadline-first order, as many at once as there are slots."""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable

from tandem.router.admission import AdmissionRequest, RejectReason, SLOClass
from tandem.router.admission.decode_capacity import DecodeCapacity
from tandem.server.background import spawn


class Dispatcher:
    """Slots: at most `limit` requests at once (--max-in-flight), and at most as many as the decode pool holds at the
    inter-token target of the tightest class among them (`decode`). A request holds its slot from dispatch to its
    last token. It also predicts, for admission, how long a request waits for a slot (`wait_s`)."""

    HOLD_ALPHA = 0.1  # weight of the newest hold time in the running mean

    def __init__(self, admission, limit: int, metrics, decode: DecodeCapacity | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.admission = admission
        self.limit = limit
        self.metrics = metrics
        self.decode = decode
        self.active = 0
        self.active_by_class: Counter[str] = Counter()
        self.waiting = 0  # requests parked in acquire(): only they need a wake-up when a slot frees
        self.mean_hold_s: float | None = None  # how long a request holds its slot, dispatch to last token
        self._held: dict[str, tuple[float, float | None]] = {}  # request id -> (dispatched at, predicted hold)
        self._clock = clock
        self._changed = asyncio.Condition()
        admission.capacity = self

    def slots(self, request: AdmissionRequest, slo: SLOClass) -> tuple[int, RejectReason, bool]:
        """(slots for requests like this one, what limits them, whether its targets can be met at all)."""
        if self.decode is None or not self.admission.enabled:
            return self.limit, RejectReason.DISPATCH_SLOTS, True
        tightest = self.tightest_itl_s()
        itl = slo.itl_s if tightest is None else min(slo.itl_s, tightest)
        output = self.admission.rates.expected_output(request.max_tokens, request.ignore_eos)
        share = 1 - self.admission.headroom
        handoff = slo.itl_s * share if request.pool == "prefill" else None  # it comes from a prefill worker
        held = self.decode.streams(itl * share, request.prompt_tokens, output, handoff)
        if held is None:
            return self.limit, RejectReason.DISPATCH_SLOTS, True
        streams, feasible = held
        if streams >= self.limit:
            return self.limit, RejectReason.DISPATCH_SLOTS, feasible
        return streams, RejectReason.DECODE_CAPACITY, feasible

    def tightest_itl_s(self) -> float | None:
        """The tightest inter-token target among the classes of the requests holding slots; None when none does."""
        classes = self.admission.slo_classes
        return min((classes[name].itl_s for name, n in self.active_by_class.items() if n and name in classes),
                   default=None)

    def hold_s(self, request: AdmissionRequest, slots: int) -> float | None:
        """How long a request like this one is predicted to hold its slot: its prefill and its expected output at the
        decode pool's step time for `slots` streams (DecodeCapacity.hold_s); the measured mean hold without a step
        cost model; None before either."""
        if self.decode is not None:
            output = self.admission.rates.expected_output(request.max_tokens, request.ignore_eos)
            decoding = self.decode.hold_s(request.prompt_tokens, output, max(slots, 1))
            if decoding is not None:
                return (request.prefill_s or 0.0) + decoding
        return self.mean_hold_s

    def wait_s(self, request: AdmissionRequest, slo: SLOClass, queued_ahead: int) -> tuple[float, RejectReason]:
        """Seconds until a slot is free for `request` with `queued_ahead` admitted requests before it (admission's
        Capacity), and what the slots are short of; math.inf when no decode worker could serve it at its targets
        even alone.

        The requests holding slots end when their predicted holds run out; the requests ahead take the slots as they
        free, in order, each holding one for a hold like this one's; this one takes the next (docs/admission.md,
        "Waiting for a slot")."""
        slots, reason, feasible = self.slots(request, slo)
        if not feasible:
            return math.inf, reason
        if queued_ahead < slots - self.active:
            return 0.0, reason
        hold = self.hold_s(request, slots)
        if hold is None:
            return 0.0, reason
        now = self._clock()
        ends = [max(0.0, start + (held if held is not None else hold) - now) for start, held in self._held.values()]
        return _slot_free_at(ends, max(1, slots), queued_ahead, hold), reason

    async def acquire(self, rid: str) -> None:
        if self._take(rid):  # a free slot and nobody ahead: no lock, no wait (the usual case)
            if self.waiting:  # the next in line may fit too
                spawn(self._notify())
            return
        async with self._changed:
            try:
                while True:
                    if self._take(rid):
                        if self.waiting:
                            self._changed.notify_all()
                        return
                    self.waiting += 1
                    try:
                        await self._changed.wait()
                    finally:
                        self.waiting -= 1
            except BaseException:
                self.admission.release(rid)  # cancelled while queued
                self._changed.notify_all()
                raise

    def _take(self, rid: str) -> bool:
        """Dispatch `rid` now if a slot is free for it and it heads the EDF queue (a request alone always goes: with
        no decode worker it is answered no_workers, not held)."""
        queue = self.admission.queue
        if not len(queue) or queue.peek().request.request_id != rid:
            return False
        head = queue.peek()
        slots = self.slots(head.request, head.slo)[0]
        if self.active >= max(1, slots):
            return False
        self.admission.pop()
        self.active += 1
        self.active_by_class[head.slo.name] += 1
        self._held[rid] = (self._clock(), self.hold_s(head.request, slots))
        return True

    def release(self, rid: str, held_s: float, slo_name: str | None = None) -> None:
        """A dispatched request is done with its slot, having held it `held_s` seconds."""
        self.active -= 1
        self._held.pop(rid, None)
        if slo_name is not None:
            self.active_by_class[slo_name] -= 1
        self.mean_hold_s = held_s if self.mean_hold_s is None else \
            self.mean_hold_s + self.HOLD_ALPHA * (held_s - self.mean_hold_s)
        self._wake_waiting()

    def capacity_changed(self) -> None:
        """The pools changed (a probe round): a request waiting for a slot may fit now."""
        self._wake_waiting()

    def withdraw(self, rid: str) -> None:
        """Take back a request admitted but not dispatched, its tenant's charge refunded (AdmissionController.withdraw)."""
        if self.admission.withdraw(rid):
            self._wake_waiting()

    def abandon(self, rid: str) -> None:
        """Forget a request whether or not it was dispatched (a no-op once released). One still queued could be
        the head of the queue, which every request behind it waits for."""
        if self.admission.release(rid):
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        if self.waiting:
            spawn(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def _slot_free_at(ends: list[float], slots: int, queued_ahead: int, hold: float) -> float:
    """When the slot of the request with `queued_ahead` requests before it frees: `ends` are the seconds until the
    requests holding slots end (more of them than `slots` when the slots shrank), each request ahead holds one for
    `hold` seconds."""
    heap = sorted(ends)
    now = 0.0
    for turn in range(queued_ahead + 1):
        while len(heap) >= slots:  # wait for the earliest end
            now = heapq.heappop(heap)
        if turn == queued_ahead:
            return now
        heapq.heappush(heap, now + hold)
    return now
