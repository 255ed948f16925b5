"""Sticky key -> worker assignments with bounded loads on keys (Mirrokni, Thorup and Zadimoghaddam's balls).

A routing key is assigned once and sticks to its worker while in use; no worker holds more than
ceil((1 + eps) x mean) active keys. Why, the guarantee, and how to choose eps: docs/design/routing.md.
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
        # Some candidate always has room (docs/design/routing.md, "Guarantee"); next() raising would be a bug.
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
