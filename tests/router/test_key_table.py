"""Sticky key assignments with bounded loads on keys, and the router's placement built on them."""

import collections
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import RouterConfig
from tandem.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator, Trace
from tandem.router.policies.key_table import KeyAssignments
from tandem.router.policies.ring import HashRing
from tandem.router.pool import Worker, WorkerPool

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def urls(n: int, salt: int = 0) -> list[str]:
    return [f"http://worker-{salt}-{i}.tandem.svc:8000" for i in range(n)]


def random_keys(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


def tally(table: KeyAssignments, keys) -> collections.Counter:
    """Active keys per worker, recounted from the table's entries."""
    return collections.Counter(w for k in set(keys) if (w := table.worker_of(k)) is not None)


# -- the key bound ----------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 12), eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]), salt=st.integers(0, 10**6),
       seed=st.integers(0, 10**6))
def test_no_worker_holds_more_than_the_key_bound(n, eps, salt, seed):
    ring = HashRing(urls(n, salt), vnodes=64)
    table = KeyAssignments(eps=eps)
    rng = random.Random(seed)
    keys = random_keys(300, seed)
    used = []
    for _ in range(600):
        key = rng.choice(keys)
        walk = list(ring.walk(key))
        bound = table.bound(walk)
        new = key not in table
        worker = table.assign(key, walk)
        used.append(key)
        counts = table.counts
        if new:
            assert counts[worker] <= bound
        # With every worker a candidate and nothing expired, the bound holds for all workers at all times.
        assert max(counts.values()) <= math.ceil((1 + eps) * len(table) / n)
        assert counts == tally(table, used)


@SETTINGS
@given(n=st.integers(2, 8), salt=st.integers(0, 10**6), seed=st.integers(0, 10**6))
def test_zero_eps_keeps_key_counts_within_one(n, salt, seed):
    ring = HashRing(urls(n, salt), vnodes=64)
    table = KeyAssignments(eps=0.0)
    for key in random_keys(5 * n + seed % n, seed):
        table.assign(key, list(ring.walk(key)))
        counts = [table.counts.get(w, 0) for w in ring.workers]
        assert max(counts) - min(counts) <= 1


def test_a_later_batch_of_keys_is_balanced_on_its_own():
    # The benchmark's shape: 32 groups, then 32 other groups while the first are still active. With eps = 0 both
    # the totals and the first batch are even, so the second batch is too, whatever the ring's luck.
    ring = HashRing(urls(4), vnodes=256)
    table = KeyAssignments(eps=0.0)
    first, second = random_keys(32, 1), random_keys(32, 2)
    for key in first:
        table.assign(key, list(ring.walk(key)))
    placed = collections.Counter(table.assign(k, list(ring.walk(k))) for k in second)
    assert sorted(placed.values()) == [8, 8, 8, 8]
    plain = collections.Counter(ring.owner(k) for k in second)
    assert max(plain.values()) > 8  # plain consistent hashing of these keys would not have been even


def test_keys_go_to_their_ring_owner_while_it_has_room():
    ring = HashRing(urls(5), vnodes=256)
    table = KeyAssignments(eps=100.0)  # a bound no worker reaches: plain consistent hashing
    for key in random_keys(500, 3):
        assert table.assign(key, list(ring.walk(key))) == ring.owner(key)


def test_a_full_owner_passes_the_key_clockwise():
    table = KeyAssignments(eps=0.0)
    assert table.assign(1, ["a", "b", "c"]) == "a"
    assert table.bound(["a", "b", "c"]) == 1  # ceil((1 + 1) / 3)
    assert table.assign(2, ["a", "b", "c"]) == "b"
    assert table.assign(3, ["a", "c", "b"]) == "c"
    assert table.assign(4, ["c", "a", "b"]) == "c"  # all at 1: the bound is 2 again and the owner has room


# -- stickiness ----------------------------------------------------------------------------------------------


def test_a_key_sticks_to_its_worker_whatever_else_arrives():
    ring = HashRing(urls(4), vnodes=64)
    table = KeyAssignments(eps=0.0)
    sticky = random_keys(1, 9)[0]
    home = table.assign(sticky, list(ring.walk(sticky)))
    for key in random_keys(200, 10):
        table.assign(key, list(ring.walk(key)))
        assert table.assign(sticky, list(ring.walk(sticky))) == home
    # Even a candidate list in another order keeps it where it is.
    assert table.assign(sticky, list(reversed(list(ring.walk(sticky))))) == home


def test_same_arrivals_give_the_same_mapping_on_two_instances():
    ring = HashRing(urls(6, salt=4), vnodes=128)
    rng = random.Random(5)
    keys = random_keys(100, 6)
    arrivals = [rng.choice(keys) for _ in range(1000)]
    a, b = KeyAssignments(eps=0.1), KeyAssignments(eps=0.1)
    assert [a.assign(k, list(ring.walk(k))) for k in arrivals] == [b.assign(k, list(ring.walk(k))) for k in arrivals]


# -- forgetting: TTL and the size cap ------------------------------------------------------------------------------


def test_idle_keys_expire_and_release_their_counts(clock):
    table = KeyAssignments(eps=0.0, ttl_s=60, clock=clock)
    table.assign(1, ["a", "b"])
    table.assign(2, ["a", "b"])
    assert table.counts == {"a": 1, "b": 1}
    clock.advance(50)
    assert table.assign(1, ["a", "b"]) == "a"  # used again: its idle time starts over
    clock.advance(20)  # key 2 idle 70 s, key 1 idle 20 s
    table.assign(3, ["b", "a"])
    assert 2 not in table and table.worker_of(1) == "a"
    assert table.counts == {"a": 1, "b": 1} and len(table) == 2
    clock.advance(61)
    table.assign(4, ["a", "b"])
    assert len(table) == 1 and table.counts == {"a": 1}


def test_the_size_cap_evicts_the_least_recently_used(clock):
    table = KeyAssignments(eps=1.0, max_keys=3, clock=clock)
    for key in (1, 2, 3):
        table.assign(key, ["a", "b"])
        clock.advance(1)
    table.assign(1, ["a", "b"])  # now 2 is the least recently used
    table.assign(4, ["a", "b"])
    assert len(table) == 3 and 2 not in table and all(k in table for k in (1, 3, 4))
    assert table.counts == tally(table, [1, 2, 3, 4])
    assert sum(table.counts.values()) == 3


@SETTINGS
@given(ops=st.lists(st.tuples(st.integers(0, 40), st.floats(0, 30)), min_size=1, max_size=200),
       max_keys=st.integers(1, 20))
def test_counts_match_the_entries_through_expiry_and_eviction(make_clock, ops, max_keys):
    clock = make_clock()
    table = KeyAssignments(eps=0.25, ttl_s=60, max_keys=max_keys, clock=clock)
    workers = urls(3)
    for key, step in ops:
        clock.advance(step)
        table.assign(key, workers[key % 3:] + workers[:key % 3])
        assert len(table) <= max_keys
        assert table.counts == tally(table, range(41))


# -- workers leaving and excluded ------------------------------------------------------------------------------


def test_keys_of_a_worker_that_left_are_placed_again_and_counts_stay_consistent():
    workers = urls(4, salt=7)
    ring = HashRing(workers, vnodes=128)
    table = KeyAssignments(eps=0.0)
    keys = random_keys(40, 11)
    before = {k: table.assign(k, list(ring.walk(k))) for k in keys}
    gone = workers[2]
    ring.remove(gone)
    after = {k: table.assign(k, list(ring.walk(k))) for k in keys}
    assert gone not in after.values()
    assert all(after[k] == before[k] for k in keys if before[k] != gone)  # nobody else's keys move
    counts = table.counts
    assert gone not in counts and sum(counts.values()) == len(keys) and counts == tally(table, keys)
    assert max(counts.values()) - min(counts.values()) <= 1  # the orphans filled the others evenly


def test_an_excluded_worker_loses_the_key():
    table = KeyAssignments(eps=1.0)
    assert table.assign(5, ["a", "b"]) == "a"
    assert table.assign(5, ["b"]) == "b"  # "a" failed this request: the key moves, and stays moved
    assert table.assign(5, ["a", "b"]) == "b"
    assert table.counts == {"b": 1}


def test_kept_is_assigns_answer_for_a_key_whose_worker_is_usable(clock):
    table = KeyAssignments(eps=0.0, ttl_s=60, clock=clock)
    assert table.kept(7, lambda w: True) is None  # never placed: assign decides
    assert table.assign(7, ["a", "b"]) == "a"
    clock.advance(50)
    assert table.kept(7, lambda w: True) == "a"  # and its idle time starts over, as assign's would
    clock.advance(20)
    assert table.worker_of(7) == "a"
    assert table.kept(7, lambda w: w != "a") is None  # "a" is excluded now: assign moves the key
    assert table.assign(7, ["b"]) == "b" and table.counts == {"b": 1}
    clock.advance(61)
    assert table.kept(7, lambda w: True) is None and len(table) == 0  # idle past the TTL: forgotten


@pytest.mark.parametrize("kwargs, message", [({"eps": -0.1}, "eps"), ({"ttl_s": 0}, "ttl_s"),
                                             ({"max_keys": 0}, "max_keys")])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyAssignments(**kwargs)


def test_no_candidates_is_refused():
    with pytest.raises(ValueError, match="no candidate"):
        KeyAssignments().assign(1, [])


# -- the router's placement ------------------------------------------------------------------------------------


@pytest.fixture
def router():
    """An orchestrator over a 4-worker decode pool (no HTTP is made: `_place` only reads the pool)."""
    metrics = RouterMetrics("test")
    http = None  # never used by placement
    decode = WorkerPool("decode", http, metrics)
    for url in urls(4, salt=3):
        decode.workers[url] = Worker(url, healthy=True)
        decode.ring.add(url)
    orchestrator = Orchestrator(RouterConfig(), WorkerPool("prefill", http, metrics), decode, http, metrics, 0)
    return orchestrator, decode


def place(orchestrator, pool, key, prompt_len=100, exclude=frozenset(), decodes_here=False):
    return orchestrator._place(pool, key, [], prompt_len, set(exclude), Trace(), decodes_here=decodes_here)


def test_placement_is_sticky_and_balanced(router):
    orchestrator, pool = router
    keys = random_keys(32, 21)
    rng = random.Random(22)
    arrivals = [k for k in keys for _ in range(8)]
    rng.shuffle(arrivals)
    where = collections.defaultdict(set)
    for key in arrivals:
        where[key].add(place(orchestrator, pool, key))
    assert all(len(w) == 1 for w in where.values())  # locality 1.0
    per_worker = collections.Counter(next(iter(w)) for w in where.values())
    assert sorted(per_worker.values()) == [8, 8, 8, 8]


def test_overload_valve_spills_one_request_and_keeps_the_key(router):
    orchestrator, pool = router
    key = random_keys(1, 30)[0]
    home = place(orchestrator, pool, key)
    others = [u for u in pool.workers if u != home]
    # Far over twice the mean and over one engine step of uncached tokens: this request goes elsewhere...
    pool.workers[home].prefill_tokens_in_flight = 10_000
    pool.workers[others[0]].prefill_tokens_in_flight = 500
    diversions = orchestrator.metrics.plain(orchestrator.metrics.overload_diversions, role="decode")
    spilled = place(orchestrator, pool, key)
    assert spilled == next(u for u in pool.ring.walk(key) if u != home)  # the first one clockwise with room
    assert diversions._value.get() == 1  # counted
    # ...and once the overload is gone the key is back home.
    pool.workers[home].prefill_tokens_in_flight = 0
    assert place(orchestrator, pool, key) == home


def test_overload_valve_ignores_small_absolute_loads(router):
    orchestrator, pool = router
    key = random_keys(1, 31)[0]
    home = place(orchestrator, pool, key)
    # All the in-flight work is on the home worker, but less than one engine step of it: not overload.
    pool.workers[home].prefill_tokens_in_flight = RouterConfig().overload_min_tokens
    assert place(orchestrator, pool, key) == home
    assert orchestrator.metrics.plain(orchestrator.metrics.overload_diversions, role="decode")._value.get() == 0


def test_one_key_asked_again_and_again_spreads_its_sequences_over_the_pool(router):
    """Colocated requests that share a key (one system prompt, one prompt repeated) keep one worker for their
    prefix, but not for all their decoding: past the sequence bound they go on, clockwise from the key, to the
    next workers, the same ones every time; each request in flight here counts until it ends."""
    orchestrator, pool = router
    key = random_keys(1, 33)[0]
    clockwise = list(pool.ring.walk(key))
    config = orchestrator.config
    diversions = orchestrator.metrics.plain(orchestrator.metrics.overload_diversions, role="decode")
    placed = collections.Counter()
    for i in range(64):  # 64 long generations in flight at once, none ended yet
        url = place(orchestrator, pool, key, decodes_here=True)
        pool.workers[url].in_flight += 1
        placed[url] += 1
        floor = orchestrator.policy.sequence_floor(pool.workers[clockwise[0]])
        bound = max(floor, (1 + config.decode_balance_eps) * (i + 1) / len(pool.workers))
        assert max(placed.values()) <= math.ceil(bound), (i, placed)
    along = [placed[u] for u in clockwise]
    assert along == sorted(along, reverse=True) and len(placed) == 3, along  # filled clockwise, [24, 24, 16, 0]
    assert diversions._value.get() == 64 - placed[clockwise[0]]
    # Its own worker's sequences end: the key is back home at once.
    pool.workers[clockwise[0]].in_flight = 0
    assert place(orchestrator, pool, key, decodes_here=True) == clockwise[0]


def test_the_sequence_valve_leaves_small_batches_and_prefills_alone(router):
    orchestrator, pool = router
    key = random_keys(1, 34)[0]
    home = place(orchestrator, pool, key)
    # Below the floor on its worker, every other one idle: small batches stay with their cache.
    pool.workers[home].in_flight = orchestrator.policy.sequence_floor(pool.workers[home]) - 1
    assert place(orchestrator, pool, key, decodes_here=True) == home
    # A prefill leaves its worker as soon as it is done: its decoding is elsewhere, so sequences do not count.
    pool.workers[home].running = 1000
    assert place(orchestrator, pool, key) == home
    # A decode worker's report counts as well as this router's own requests (other replicas send there too).
    assert place(orchestrator, pool, key, decodes_here=True) != home


def test_the_sequence_floor_is_an_eighth_of_the_batch_a_worker_is_set_up_for_unless_given(router):
    """A GPU worker set up for batches of 256 decodes 31 sequences about as fast as one: its colocated requests of
    one key stay on it until 32; one set up for the default 64 until 8, as one that reports nothing. A given floor
    is kept."""
    orchestrator, pool = router
    key = random_keys(1, 35)[0]
    home = place(orchestrator, pool, key)
    worker = pool.workers[home]
    assert orchestrator.policy.sequence_floor(worker) == 8  # reports no max_num_seqs
    worker.max_num_seqs = 256
    assert orchestrator.policy.sequence_floor(worker) == 32
    worker.in_flight = 31
    assert place(orchestrator, pool, key, decodes_here=True) == home
    worker.in_flight = 32
    assert place(orchestrator, pool, key, decodes_here=True) != home
    worker.max_num_seqs = 64
    assert orchestrator.policy.sequence_floor(worker) == 8
    orchestrator.config = orchestrator.policy.config = orchestrator.config.model_copy(
        update={"decode_overload_min_seqs": 40})
    assert orchestrator.policy.sequence_floor(worker) == 40


def test_an_excluded_worker_is_not_chosen(router):
    orchestrator, pool = router
    key = random_keys(1, 32)[0]
    home = place(orchestrator, pool, key)
    assert place(orchestrator, pool, key, exclude={home}) != home
    assert place(orchestrator, pool, key, exclude=set(pool.workers)) is None


def test_a_full_table_is_invisible_to_the_garbage_collector():
    """Its entries are untracked once the collector has seen them, so a table of 100,000 keys does not lengthen
    the full collections that pause the router's event loop."""
    import gc

    table = KeyAssignments(max_keys=1000)
    for key in range(1000):
        table.assign(key, ["http://a", "http://b"])
    table.assign(5, ["http://a", "http://b"])  # a key used again gets a fresh entry
    gc.collect()
    assert not any(gc.is_tracked(entry) for entry in table._table.values())


def test_a_prompt_longer_than_the_predictors_memory_keeps_its_first_blocks():
    """The predictor keeps a bounded number of blocks per worker, evicting the oldest: a long prompt's first blocks
    are kept over its last ones, since a prompt whose first block is gone matches nothing after it."""
    from tandem.router.prefix_predictor import PrefixPredictor

    predictor = PrefixPredictor(block_size=16, capacity_blocks=8)
    hashes = list(range(100, 112))  # 12 blocks
    predictor.record("w", hashes)
    assert predictor.best_hit_tokens(["w"], hashes, 12 * 16 + 1) == 8 * 16
