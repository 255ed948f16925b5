"""Round robin: each pool's workers in rotation, in turn. A baseline that ignores caches and loads."""

from __future__ import annotations

from tandem.router.policies.base import Placement, usable
from tandem.router.pool import WorkerPool


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._turns: dict[WorkerPool, int] = {}  # placements made per pool

    def place(self, pool: WorkerPool, request: Placement) -> str | None:
        return self._next(pool, request.exclude)

    def pick_decode(self, pool: WorkerPool, needed_blocks: int, exclude: set[str]) -> str | None:
        return self._next(pool, exclude)

    def _next(self, pool: WorkerPool, exclude: set[str]) -> str | None:
        urls = usable(pool, exclude)
        if not urls:
            return None
        turn = self._turns.get(pool, 0)
        self._turns[pool] = turn + 1
        return urls[turn % len(urls)]
