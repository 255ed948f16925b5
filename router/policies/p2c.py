"""Power of two choices for decode workers, in the filters -> scorer -> picker shape of llm-d's scheduler.

Decode workers report their free KV blocks and running sequences, and the router's copy of those reports is
always a little stale. Sending every request to the best-looking worker makes all router replicas herd onto
the same one until the next report; sampling two workers at random and taking the better of the two avoids
the herd while keeping the maximum load within O(log log n) of the mean instead of O(log n / log log n)
for one random choice (Mitzenmacher 2001).

Stages, each usable on its own:
- filters: `healthy` drops workers out of rotation; `with_room` keeps the workers whose free blocks hold
  the request's KV blocks, unless none does (the request then waits or preempts on some worker rather than
  being refused).
- scorer: `decode_score` = free KV blocks / (running sequences + 1): the KV headroom each sequence would
  have, this request included. It rises with free memory (fewer preemptions) and falls with batch size
  (inter-token latency grows with the batch). The router should count requests it has dispatched but the
  worker has not yet reported in `running_seqs`, so that a burst between two reports spreads out.
- picker: `PowerOfTwoChoices.pick` samples two distinct candidates with the injected `random.Random` and
  returns the higher-scoring one (fewer running sequences on a tie, then the first sampled).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeWorkerState:
    """What the router knows about one decode worker."""

    url: str
    free_kv_blocks: int
    running_seqs: int
    healthy: bool = True

    def __post_init__(self):
        if self.free_kv_blocks < 0:
            raise ValueError(f"{self.url}: free_kv_blocks must be >= 0, got {self.free_kv_blocks}")
        if self.running_seqs < 0:
            raise ValueError(f"{self.url}: running_seqs must be >= 0, got {self.running_seqs}")


def healthy(workers: Sequence[DecodeWorkerState]) -> list[DecodeWorkerState]:
    return [w for w in workers if w.healthy]


def with_room(workers: Sequence[DecodeWorkerState], needed_blocks: int) -> list[DecodeWorkerState]:
    """The workers that can hold `needed_blocks` more KV blocks, or all of them when none can."""
    roomy = [w for w in workers if w.free_kv_blocks >= needed_blocks]
    return roomy or list(workers)


def decode_score(worker: DecodeWorkerState) -> float:
    """Free KV blocks per running sequence, counting the request being placed; higher is better."""
    return worker.free_kv_blocks / (worker.running_seqs + 1)


class PowerOfTwoChoices:
    """Picks a decode worker: healthy -> with room -> best of two random candidates by `decode_score`."""

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng if rng is not None else random.Random()

    def pick(self, workers: Sequence[DecodeWorkerState], needed_blocks: int = 0) -> str:
        """URL of the chosen worker; LookupError when no worker is healthy."""
        if needed_blocks < 0:
            raise ValueError(f"needed_blocks must be >= 0, got {needed_blocks}")
        urls = [w.url for w in workers]
        if len(set(urls)) != len(urls):
            raise ValueError(f"decode workers listed twice: {sorted({u for u in urls if urls.count(u) > 1})}")
        # Sorted so that the same seed picks the same worker whatever order discovery listed them in.
        candidates = sorted(with_room(healthy(workers), needed_blocks), key=lambda w: w.url)
        if not candidates:
            raise LookupError("no healthy decode worker")
        sampled = self.rng.sample(candidates, min(2, len(candidates)))
        return max(sampled, key=lambda w: (decode_score(w), -w.running_seqs)).url
