"""The router's guess of which prompt blocks each worker has cached.

Every prompt routed to a worker leaves its full-block hashes in that worker's LRU set (bounded),
mirroring what the worker's prefix cache will hold. The guess feeds the load estimate (only
uncached tokens cost prefill time) and the predicted-vs-reported prefix-hit metrics.

Admission also counts what admitted requests are about to compute (`expect`), before placement says where: a
burst of requests behind one new system prompt goes to one worker (the hashing key is the prompt's first blocks),
whose engine computes the prefix once for them all (workers/engine/block_manager.py), so charging each of them all
of it refused most of such a burst for time it would not take.
"""

from __future__ import annotations

from collections import OrderedDict

# How long an admitted request's prefix counts as about to be computed (`expect`): its wait to be placed, after
# which placement's record of it takes over.
EXPECT_S = 10.0


class PrefixPredictor:
    def __init__(self, block_size: int, capacity_blocks: int = 65536):
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._seen: dict[str, OrderedDict[int, None]] = {}
        self._expected: OrderedDict[int, float] = OrderedDict()  # block hash -> when a request expected it, oldest first

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

    def admission_hit_tokens(self, workers, hashes: list[int], prompt_len: int, now: float) -> int:
        """best_hit_tokens, or more where requests admitted in the last EXPECT_S are to compute the prompt's first
        blocks (`expect`): the tokens admission need not charge this prompt."""
        best = self.best_hit_tokens(workers, hashes, prompt_len)
        expected = self._expected
        while expected and next(iter(expected.values())) < now - EXPECT_S:
            expected.popitem(last=False)
        if expected:
            hits = 0
            for h in hashes:
                if h not in expected:
                    break
                hits += 1
            best = max(best, min(hits * self.block_size, max(prompt_len - 1, 0)))
        return best

    def expect(self, hashes: list[int], now: float) -> None:
        """An admitted request is to compute these blocks, on a worker not chosen yet."""
        expected = self._expected
        for h in hashes:
            expected[h] = now
            expected.move_to_end(h)
        while len(expected) > self.capacity:
            expected.popitem(last=False)

    def record(self, worker: str, hashes: list[int]) -> None:
        seen = self._seen.setdefault(worker, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, worker: str) -> None:
        self._seen.pop(worker, None)
