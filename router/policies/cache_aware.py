"""Cache-aware placement, the default: sticky bounded-load consistent hashing for prompts, power of two choices
for decodes (docs/design/routing.md).

A prompt goes to its routing key's sticky worker (key_table.py over ring.py), so that prompts sharing a prefix
meet their cache. Two overload valves divert one request at a time: the prefill valve (uncached prompt tokens in
flight) always, the sequence valve too when the request will also decode there. A prefilled request's decode
worker is the better of two sampled by free KV blocks per sequence (p2c.py).
"""

from __future__ import annotations

from tandem.config import RouterConfig
from tandem.metrics import RouterMetrics
from tandem.router.policies.base import Placement
from tandem.router.policies.key_table import KeyAssignments
from tandem.router.policies.p2c import PowerOfTwoChoices
from tandem.router.pool import Worker, WorkerPool
from tandem.router.prefix_predictor import PrefixPredictor

# The sequence valve's floor, unless given: an eighth of a decode worker's max_num_seqs.
SEQUENCE_FLOOR_SHARE = 8


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: RouterConfig, predictor: PrefixPredictor, metrics: RouterMetrics):
        self.config = config
        self.predictor = predictor
        self.metrics = metrics
        self.p2c = PowerOfTwoChoices()
        self._key_tables: dict[WorkerPool, KeyAssignments] = {}  # one sticky key table per pool

    def place(self, pool: WorkerPool, request: Placement) -> str | None:
        """The key's sticky worker among the pool's healthy workers less `exclude`, unless a valve diverts this
        one request."""
        ring, key, exclude = pool.ring, request.key, request.exclude
        table = self._key_table(pool)
        # A key seen before keeps its worker (the usual case) without listing the candidates.
        preferred = table.kept(key, lambda u: u in ring and u not in exclude)
        candidates = None
        if preferred is None:
            candidates = _candidates(ring, key, exclude)
            if not candidates:
                return None
            preferred = table.assign(key, candidates)
        url = preferred
        # The prefill valve; its cheap test first: below one engine step of tokens (the usual case) the bound
        # is not needed. The bound is the ring's (1 + eps) x mean after placement, with one request of slack.
        # A diverted request leaves its key assigned where it is: overload is transient, the key's cache is not.
        preferred_load = pool.workers[preferred].prefill_tokens_in_flight
        if preferred_load > self.config.overload_min_tokens:
            weight = max(request.prompt_len - self.predictor.predicted_hit_tokens(preferred, request.hashes,
                                                                                    request.prompt_len), 1)
            loads = pool.prefill_loads()
            capacity = ring.capacity(loads, self.config.balance_eps, weight)
            if preferred_load > capacity:
                if candidates is None:
                    candidates = _candidates(ring, key, exclude)
                url = first_with_room([preferred, *(u for u in candidates if u != preferred)], loads, weight,
                                      capacity)
        if request.decodes_here and url == preferred:
            url = self._spread_sequences(pool, key, preferred, exclude)
        if url != preferred:
            self.metrics.plain(self.metrics.overload_diversions, role=pool.role).inc()
        return url

    def pick_decode(self, pool: WorkerPool, needed_blocks: int, exclude: set[str]) -> str | None:
        """By free KV blocks and running sequences, the better of two sampled."""
        states = pool.decode_states(exclude=exclude)
        return self.p2c.pick(states, needed_blocks=needed_blocks) if any(s.healthy for s in states) else None

    def _spread_sequences(self, pool: WorkerPool, key: int, preferred: str, exclude: set[str]) -> str:
        """The sequence valve, for a request that decodes where it prefills: a key keeps one worker however many
        requests share it, and a cached prompt costs no prefill, its decoding does. A worker holding at least
        its floor (`sequence_floor`) and over (1 + decode_balance_eps) x the pool's mean sequences after placement
        passes the request clockwise from the key to the first worker under that bound."""
        home = pool.workers[preferred]
        held = home.sequences_held
        if held < self.sequence_floor(home):  # the usual case: no need for the pool's loads
            return preferred
        loads = {w.url: w.sequences_held for w in pool.healthy() if w.url not in exclude}
        bound = (1 + self.config.decode_balance_eps) * (sum(loads.values()) + 1) / len(loads)
        if held + 1 <= bound:
            return preferred
        return first_with_room([u for u in _candidates(pool.ring, key, exclude) if u in loads], loads, 1, bound)

    def sequence_floor(self, worker: Worker) -> int:
        """The sequences a decode worker holds before the sequence valve looks at the pool:
        --decode-overload-min-seqs if given, else an eighth of the max_num_seqs it reports (a batch about as
        quick to decode as one sequence)."""
        if self.config.decode_overload_min_seqs is not None:
            return self.config.decode_overload_min_seqs
        return max(1, worker.max_num_seqs // SEQUENCE_FLOOR_SHARE)

    def _key_table(self, pool: WorkerPool) -> KeyAssignments:
        table = self._key_tables.get(pool)
        if table is None:
            table = self._key_tables[pool] = KeyAssignments(self.config.key_eps, self.config.key_ttl_s,
                                                                 self.config.max_routing_keys)
        return table


def _candidates(ring, key: int, exclude: set[str]) -> list[str]:
    """The ring's workers less `exclude`, clockwise from `key`."""
    return [u for u in ring.walk(key) if u not in exclude] if len(ring) else []


def first_with_room(ordered: list[str], loads: dict[str, float], weight: float, bound: float) -> str:
    """An overload valve's choice: the first of `ordered` whose load plus `weight` stays within `bound`, else the
    least loaded of them."""
    return next((u for u in ordered if loads.get(u, 0) + weight <= bound), None) \
        or min(ordered, key=lambda u: loads.get(u, 0))
