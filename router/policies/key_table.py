"""Sticky key -> worker assignments with bounded loads on keys, the balls of Mirrokni, Thorup and Zadimoghaddam.

Why. The router used to bound each worker's *uncached prompt tokens in flight* (`HashRing.lookup` with
eps = 0.25). On benchmarks/router.py's locality workload (32 prompt-prefix groups, 4 mock backends) that gave
locality 0.55-0.60 at concurrency 16 (about 4 requests in flight per worker, so ordinary fluctuation crosses a
1.25 x mean bound all the time and pushes requests off the worker that caches their prefix) and max/mean load
1.50-1.62 at concurrency 1 (nothing is in flight, so balance is how 32 keys happen to hash onto 4 workers; no
stateless hash does better with so few keys: median 1.38 over random rings). The paper bounds the load of
*clients* (keys), each of which sticks to its server. Here every routing key is assigned once and sticks to
its worker while it stays in use, and the bound applies to how many active keys a worker holds, which does not
fluctuate with timing. The router's in-flight bound stays, much looser, as an overload valve for hot keys.

Placement. A key seen before whose worker is still a candidate stays there. A new key (or one whose worker
left the ring or is excluded) walks the ring clockwise from the key and takes the first worker that still
has room:

    count(worker) + 1 <= ceil((1 + eps) * (active keys on the candidates + 1) / n)

Guarantee: no worker holds more than ceil((1 + eps) x mean) active keys. It holds at every placement; between
placements only expiry or a worker leaving can lower the mean under a count (those keys stay where they are).
Some worker always has room, because n workers all at the bound would already hold more than the total. The
bound is on keys, not requests: a hot key still lands on one worker, which is what the overload valve is for.

Active keys. A key not used for `ttl_s` seconds is forgotten, and the table keeps at most `max_keys` keys
(least recently used go first), so memory is bounded and the counts follow the keys that carry traffic. A
forgotten key that returns is placed again from scratch. Each request costs O(1) amortised plus O(n) over the
candidates (about 1-3 us in CPython with 4 workers).

Choosing eps (the router's default is 0). The bound is relative to *all* active keys, so with eps > 0 the keys
that carry traffic right now can be unbalanced by up to eps x (all active keys) / n: thousands of one-off
prompts make the bound loose for the few recurring prefixes, and a burst of new prefixes right after another
set of prefixes went idle is placed almost by plain hashing. Simulating the benchmark's shape (32 groups, then
32 new ones; with and without thousands of one-off keys first), max/mean > 1.25 for the second batch in 44-70%
of random rings with eps = 0.25 and 22-70% with eps = 0.1, never with eps = 0: every placement then goes to a
worker with the fewest keys, so counts stay within one of each other (until keys expire or a worker leaves) and
every batch of keys is spread as evenly as the total.

Trade-off. Router replicas share no state. Two replicas build identical rings and map a key identically
whenever its ring owner has room; a key whose owner is at its key bound goes to the next worker with room,
and which worker that is depends on the order in which keys arrived at that replica. The tighter the bound,
the more often that happens: with 4 workers, two replicas that see the same keys in different orders agree on
roughly half of them at eps = 0, 70% at 0.1 and 80-87% at 0.25 (simulated). A key mapped differently is cached on
one worker per replica: one extra cold prefill per replica, after which each replica sticks to its choice.
Also, at eps = 0 an empty worker that joins takes every new key until it holds its share (existing keys stay
put); if that overloads it, the valve spills. Raise `key_eps` (RouterConfig) to favour replica agreement.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

DEFAULT_KEY_EPS = 0.0
DEFAULT_TTL_S = 600.0
DEFAULT_MAX_KEYS = 100_000


class KeyAssignments:
    """The sticky key table of one worker pool."""

    def __init__(self, eps: float = DEFAULT_KEY_EPS, ttl_s: float = DEFAULT_TTL_S, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.eps = eps
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.clock = clock
        # key -> (worker, last used), least recently used first: expiry and the size cap both pop from the front.
        # Plain tuples of a str and a float: the garbage collector stops tracking them once it has seen them, so
        # a full table (100,000 keys by default) adds one object, not 100,000, to the collections that pause the
        # event loop.
        self._table: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        return key in self._table

    @property
    def counts(self) -> Mapping[str, int]:
        """Active keys per worker (workers with none are absent), including workers no longer on the ring whose
        keys have not been used or expired since they left."""
        return dict(self._counts)

    def worker_of(self, key: int) -> str | None:
        """The worker `key` is assigned to, without touching it; None when it is not in the table."""
        entry = self._table.get(key)
        return entry[0] if entry is not None else None

    def bound(self, candidates: Sequence[str]) -> int:
        """ceil((1 + eps) * (active keys on `candidates` + 1) / n): the most keys a candidate may hold after taking
        one more."""
        if not candidates:
            raise ValueError("no candidate workers")
        total = sum(self._counts.get(w, 0) for w in candidates)
        return math.ceil((1 + self.eps) * (total + 1) / len(candidates))

    def kept(self, key: int, usable: Callable[[str], bool]) -> str | None:
        """The worker `key` sticks to when it has one and `usable(worker)`: assign's first case, decided without
        the candidates, which cost a walk of the ring to list. None: call assign."""
        now = self.clock()
        self._expire(now)
        entry = self._table.get(key)
        if entry is None or not usable(entry[0]):
            return None
        self._table[key] = (entry[0], now)
        self._table.move_to_end(key)
        return entry[0]

    def assign(self, key: int, candidates: Sequence[str]) -> str:
        """The worker for `key`. `candidates` are the workers it may use, in the ring's clockwise order from the
        key (`HashRing.walk(key)` less any excluded worker)."""
        if not candidates:
            raise ValueError("no candidate workers")
        worker = self.kept(key, candidates.__contains__)
        if worker is not None:
            return worker
        if key in self._table:
            self._drop(key)  # its worker left the ring or is excluded: place it again
        now = self.clock()
        bound = self.bound(candidates)
        # Some candidate always has room (see the module docstring); next() raising would be a bug.
        worker = next(w for w in candidates if self._counts.get(w, 0) + 1 <= bound)
        self._table[key] = (worker, now)
        self._counts[worker] = self._counts.get(worker, 0) + 1
        while len(self._table) > self.max_keys:
            self._drop(next(iter(self._table)))
        return worker

    def _expire(self, now: float) -> None:
        deadline = now - self.ttl_s
        while self._table:
            key, (_, last_used) = next(iter(self._table.items()))
            if last_used > deadline:
                return
            self._drop(key)

    def _drop(self, key: int) -> None:
        worker, _ = self._table.pop(key)
        left = self._counts[worker] - 1
        if left:
            self._counts[worker] = left
        else:
            del self._counts[worker]
