"""Power of two choices for decode workers, as filters -> scorer -> picker (llm-d's scheduler shape).

`healthy` and `with_room` filter, `decode_score` (free KV blocks per sequence) scores, `PowerOfTwoChoices.pick`
takes the better of two sampled. Why: docs/design/routing.md.
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
