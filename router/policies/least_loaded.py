"""Least loaded: the worker with the least work on it. A baseline that balances and ignores caches.

A prefill goes to the worker with the fewest uncached prompt tokens in flight; a request that decodes goes to
the one holding the fewest sequences. Ties go to the earlier URL.
"""

from __future__ import annotations

from tandem.router.policies.base import Placement, usable
from tandem.router.pool import WorkerPool


class LeastLoaded:
    name = "least_loaded"

    def place(self, pool: WorkerPool, request: Placement) -> str | None:
        urls = usable(pool, request.exclude)
        if request.decodes_here:
            return self._fewest_sequences(pool, urls)
        return min(urls, key=lambda u: (pool.workers[u].prefill_tokens_in_flight, pool.workers[u].in_flight),
                   default=None)

    def pick_decode(self, pool: WorkerPool, needed_blocks: int, exclude: set[str]) -> str | None:
        return self._fewest_sequences(pool, usable(pool, exclude))

    @staticmethod
    def _fewest_sequences(pool: WorkerPool, urls: list[str]) -> str | None:
        return min(urls, key=lambda u: pool.workers[u].sequences_held, default=None)
