"""The router's sticky key table (router/policies/key_table.py) simulated: how `--key-eps` trades balance against
agreement between router replicas, and what a placement costs. No router and no workers: the table and the hash
ring the router uses (router/policies/ring.py), fed routing keys; the figures in docs/design/routing.md.

(a) Balance of a second batch: on a random ring of 4 workers, 32 keys are placed, then (after 0 or 2,000 one-off
    keys, each used once) 32 new ones; the share of rings where the new batch's max/mean keys per worker is over
    1.25, per eps.
(b) Replica agreement: two tables (two router replicas) get the same 32 keys in two random orders; the share of
    keys both map to the same worker, per eps.
(c) Cost: microseconds per placement of a recurring key with 4 workers (kept, as a request's common case) and of a
    new key (assign over the ring's walk), on this machine.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/key_table_sim.py [--rings 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter

from tandem.router.policies.key_table import KeyAssignments
from tandem.router.policies.ring import HashRing

WORKERS, GROUPS, ONE_OFF = 4, 32, 2000
EPS = (0.0, 0.1, 0.25)


def ring(rng: random.Random) -> HashRing:
    return HashRing(f"http://10.0.{rng.randrange(256)}.{rng.randrange(256)}:8000" for _ in range(WORKERS))


def place(table: KeyAssignments, hash_ring: HashRing, key: int) -> str:
    return table.assign(key, list(hash_ring.walk(key)))


def max_over_mean(workers: list[str]) -> float:
    counts = Counter(workers)
    return max(counts.values()) / (len(workers) / WORKERS)


def second_batch_unbalanced(eps: float, one_off: int, rings: int, seed: int) -> float:
    rng = random.Random(seed)
    over = 0
    for _ in range(rings):
        hash_ring, table = ring(rng), KeyAssignments(eps=eps)
        for _ in range(GROUPS):
            place(table, hash_ring, rng.getrandbits(64))
        for _ in range(one_off):
            place(table, hash_ring, rng.getrandbits(64))
        second = [place(table, hash_ring, rng.getrandbits(64)) for _ in range(GROUPS)]
        over += max_over_mean(second) > 1.25
    return over / rings


def agreement(eps: float, rings: int, seed: int) -> float:
    rng = random.Random(seed)
    alike = []
    for _ in range(rings):
        hash_ring = ring(rng)
        keys = [rng.getrandbits(64) for _ in range(GROUPS)]
        orders = [keys[:], keys[:]]
        for order in orders:
            rng.shuffle(order)
        tables = [KeyAssignments(eps=eps), KeyAssignments(eps=eps)]
        for table, order in zip(tables, orders, strict=True):
            for key in order:
                place(table, hash_ring, key)
        alike.append(sum(tables[0].worker_of(k) == tables[1].worker_of(k) for k in keys) / GROUPS)
    return statistics.mean(alike)


def cost_us(seed: int, repeats: int = 20000) -> tuple[float, float]:
    rng = random.Random(seed)
    hash_ring, table = ring(rng), KeyAssignments(eps=0.0)
    keys = [rng.getrandbits(64) for _ in range(GROUPS)]
    for key in keys:
        place(table, hash_ring, key)
    started = time.perf_counter()
    for i in range(repeats):
        table.kept(keys[i % GROUPS], hash_ring.__contains__)
    kept = (time.perf_counter() - started) / repeats
    new = [rng.getrandbits(64) for _ in range(repeats)]
    started = time.perf_counter()
    for key in new:
        place(table, hash_ring, key)
    return kept * 1e6, (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rings", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{WORKERS} workers, {GROUPS} keys a batch, {args.rings} random rings per cell")
    print("\n(a) rings where the second batch's max/mean > 1.25")
    print(f"{'eps':>5} {'no one-off keys':>16} {f'{ONE_OFF:,} one-off keys first':>26}")
    for eps in EPS:
        print(f"{eps:>5} {second_batch_unbalanced(eps, 0, args.rings, args.seed):>16.0%} "
              f"{second_batch_unbalanced(eps, ONE_OFF, args.rings, args.seed):>26.0%}")
    print("\n(b) keys two replicas map alike (same keys, two random orders)")
    for eps in EPS:
        print(f"{eps:>5} {agreement(eps, args.rings, args.seed):>8.0%}")
    kept, new = cost_us(args.seed)
    print(f"\n(c) per placement, {WORKERS} workers: a recurring key (kept) {kept:.2f} us, a new key (assign) {new:.2f} us")


if __name__ == "__main__":
    main()
