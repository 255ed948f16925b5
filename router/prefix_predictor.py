"""The router's guess of which prompt blocks each worker has cached.

Every prompt routed to a worker leaves its full-block hashes in that worker's LRU set (bounded),
mirroring what the worker's prefix cache will hold. The guess feeds the load estimate (only
uncached tokens cost prefill time) and the predicted-vs-reported prefix-hit metrics.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixPredictor:
    def __init__(self, block_size: int, capacity_blocks: int = 65536):
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def predicted_hit_tokens(self, worker: str, hashes: list[int], prompt_len: int) -> int:
        return self.best_hit_tokens((worker,), hashes, prompt_len)

    def best_hit_tokens(self, workers, hashes: list[int], prompt_len: int) -> int:
        """The most prompt tokens any of `workers` is expected to have cached (one pass, not a call per worker:
        the router asks this of every request)."""
        best = 0
        for worker in workers:
            seen = self._seen.get(worker)
            if seen:
                hits = 0
                for h in hashes:
                    if h not in seen:
                        break
                    hits += 1
                if hits > best:
                    best = hits
        # Engines always compute at least the last prompt token.
        return min(best * self.block_size, max(prompt_len - 1, 0))

    def record(self, worker: str, hashes: list[int]) -> None:
        seen = self._seen.setdefault(worker, OrderedDict())
        # Tail first, so that a prompt's first blocks are the most recent: eviction takes the oldest, and a prompt
        # whose first block is gone matches nothing after it (the hashes chain from the first block).
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, worker: str) -> None:
        self._seen.pop(worker, None)
