"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016) for prefill workers.

A key goes to the first worker clockwise on a ring of virtual nodes that every router replica builds alike; a
worker over ceil((1 + eps) x mean) load passes it on. The bound and its guarantee: docs/design/routing.md.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tandem.hashing import block_hashes, hash_block

# Points per worker. Each worker's share of the ring is Beta(V, (N-1)V)-distributed, so with 2 workers the
# split is 50% +- 1/(2 sqrt(2V)): +-1.1% standard deviation at 1024, +-3.1% at the ketama-style 128. Small
# pools are common, and a share error is both a load imbalance and extra key movement on rescale.
DEFAULT_VNODES = 1024
_RING_SIZE = 1 << 64


def point(label: str) -> int:
    """Position of a label on the 64-bit ring (unsigned, little-endian blake2b-64)."""
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")


def routing_key(token_ids: Sequence[int], block_size: int, seed: int, k: int,
                hashes: Sequence[int] | None = None) -> int:
    """Ring key of a prompt: the chained hash of its first `k` full blocks (the last of those hashes, which
    names the whole prefix), or of fewer when the prompt is shorter. A prompt with no full block is hashed
    whole as one short block on the seed (its payload is shorter than any full block's, so it cannot stand
    for a cached block except by a 64-bit collision). `hashes`: the prompt's block hashes, when the caller
    has them already."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if k < 1:
        raise ValueError(f"k (blocks in the routing key) must be >= 1, got {k}")
    if hashes is None:
        hashes = block_hashes(token_ids[: k * block_size], block_size, seed)
    return hashes[min(k, len(hashes)) - 1] if hashes else hash_block(seed, token_ids)


class HashRing:
    """A consistent-hash ring of worker URLs with bounded-load lookup."""

    def __init__(self, workers: Iterable[str] = (), vnodes: int = DEFAULT_VNODES):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        # Parallel sorted lists: _positions for bisect, _owners[i] the worker at _positions[i]. Points sort by
        # (position, url), so even a 64-bit collision orders the same way on every replica.
        self._positions: list[int] = []
        self._owners: list[str] = []
        self._workers: set[str] = set()
        for worker in workers:
            self.add(worker)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(sorted(self._workers))

    @property
    def points(self) -> tuple[tuple[int, str], ...]:
        """(position, worker) of every virtual node, in ring order."""
        return tuple(zip(self._positions, self._owners, strict=True))

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def add(self, worker: str) -> None:
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"worker must be a non-empty URL string, got {worker!r}")
        if worker in self._workers:
            raise ValueError(f"worker {worker!r} is already on the ring")
        new_points = [(point(f"{worker}#{i}"), worker) for i in range(self.vnodes)]
        merged = sorted([*zip(self._positions, self._owners, strict=True), *new_points])
        self._positions = [p for p, _ in merged]
        self._owners = [w for _, w in merged]
        self._workers.add(worker)

    def remove(self, worker: str) -> None:
        if worker not in self._workers:
            raise ValueError(f"worker {worker!r} is not on the ring")
        kept = [(p, w) for p, w in zip(self._positions, self._owners, strict=True) if w != worker]
        self._positions = [p for p, _ in kept]
        self._owners = [w for _, w in kept]
        self._workers.remove(worker)

    def walk(self, key: int) -> Iterator[str]:
        """Every worker once, in the clockwise order of their first point at or after `key` (wrapping)."""
        if not 0 <= key < _RING_SIZE:
            raise ValueError(f"key must be an unsigned 64-bit int, got {key}")
        start = bisect.bisect_left(self._positions, key)
        seen: set[str] = set()
        count = len(self._owners)
        for offset in range(count):
            owner = self._owners[(start + offset) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._workers):
                    return

    def owner(self, key: int) -> str:
        """The worker that owns `key` when loads are ignored (plain consistent hashing)."""
        if not self._workers:
            raise LookupError("the hash ring has no workers")
        return next(self.walk(key))

    def capacity(self, loads: Mapping[str, float], eps: float, weight: float = 1.0) -> int:
        """ceil((1 + eps) * (total_load + weight) / n): the most load any worker may hold after placement."""
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight}")
        total = 0.0
        for worker in self._workers:
            load = loads.get(worker, 0.0)
            if load < 0:
                raise ValueError(f"load of {worker!r} is negative ({load})")
            total += load
        return math.ceil((1 + eps) * (total + weight) / len(self._workers))

    def lookup(self, key: int, loads: Mapping[str, float], eps: float, weight: float = 1.0) -> str:
        """The first worker clockwise from `key` that stays within the bounded-load capacity after taking a
        request of `weight`; workers absent from `loads` have load 0, entries for other workers are ignored."""
        if not self._workers:
            raise LookupError("the hash ring has no workers")
        capacity = self.capacity(loads, eps, weight)
        passed_over: list[str] = []
        for worker in self.walk(key):
            if loads.get(worker, 0.0) + weight <= capacity:
                return worker
            passed_over.append(worker)
        # Only a weighted request can get here (docs/design/routing.md); min() keeps the first in walk order.
        return min(passed_over, key=lambda w: loads.get(w, 0.0))
