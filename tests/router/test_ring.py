"""Consistent hashing with bounded loads: key movement, the load bound, replica agreement, locality."""

import collections
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.hashing import block_hashes, hash_block, model_seed
from tandem.router.policies.ring import HashRing, point, routing_key

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def urls(n: int, salt: int = 0) -> list[str]:
    return [f"http://prefill-{salt}-{i}.tandem.svc:8000" for i in range(n)]


def random_keys(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


# -- routing keys ----------------------------------------------------------------------------------------


def test_routing_key_is_last_of_first_k_block_hashes():
    seed = model_seed("smollm2")
    prompt = list(range(100))
    assert routing_key(prompt, 16, seed, k=4) == block_hashes(prompt, 16, seed)[3]
    # Prompts that share the first k blocks share the key, whatever follows.
    assert routing_key(prompt[:64] + [7, 8, 9], 16, seed, k=4) == routing_key(prompt, 16, seed, k=4)
    assert routing_key(prompt[:63] + [7] + prompt[64:], 16, seed, k=4) != routing_key(prompt, 16, seed, k=4)
    # Fewer than k full blocks: the last full one.
    assert routing_key(prompt[:40], 16, seed, k=4) == block_hashes(prompt[:40], 16, seed)[1]
    # The same keys from block hashes the caller already has (the router hashes each prompt once).
    for p in (prompt, prompt[:40], prompt[:64] + [7, 8, 9], [5, 6, 7]):
        assert routing_key(p, 16, seed, k=4, hashes=block_hashes(p, 16, seed)) == routing_key(p, 16, seed, k=4)


def test_short_prompt_key_hashes_the_whole_prompt():
    seed = model_seed("smollm2")
    assert routing_key([5, 6, 7], 16, seed, k=4) == hash_block(seed, [5, 6, 7])
    assert routing_key([5, 6, 7], 16, seed, k=4) != routing_key([5, 6, 8], 16, seed, k=4)
    assert routing_key([5, 6, 7], 16, model_seed("other"), k=4) != routing_key([5, 6, 7], 16, seed, k=4)


@pytest.mark.parametrize("block_size, k", [(0, 4), (16, 0)])
def test_routing_key_rejects_bad_arguments(block_size, k):
    with pytest.raises(ValueError):
        routing_key([1, 2, 3], block_size, 0, k)


# -- ring basics -----------------------------------------------------------------------------------------


def test_points_are_blake2b_of_url_and_index():
    import hashlib

    ring = HashRing(["http://a:1"], vnodes=8)
    expected = sorted(int.from_bytes(hashlib.blake2b(f"http://a:1#{i}".encode(), digest_size=8).digest(), "little")
                      for i in range(8))
    assert [position for position, _ in ring.points] == expected
    assert {worker for _, worker in ring.points} == {"http://a:1"}
    assert point("http://a:1#0") in expected


def test_lookup_walks_clockwise_and_wraps():
    ring = HashRing(["http://a:1", "http://b:1"], vnodes=1)
    pa, pb = point("http://a:1#0"), point("http://b:1#0")
    first, second = ("http://a:1", "http://b:1") if pa < pb else ("http://b:1", "http://a:1")
    low, high = min(pa, pb), max(pa, pb)
    assert ring.owner(low) == first  # a key exactly on a point belongs to that point
    assert ring.owner(low + 1) == second
    assert ring.owner(high + 1) == first  # past the last point the walk wraps to the first
    assert list(ring.walk(low + 1)) == [second, first]


def test_membership_errors():
    ring = HashRing()
    with pytest.raises(LookupError):
        ring.lookup(1, {}, 0.25)
    ring.add("http://a:1")
    with pytest.raises(ValueError, match="already"):
        ring.add("http://a:1")
    with pytest.raises(ValueError, match="not on the ring"):
        ring.remove("http://b:1")
    with pytest.raises(ValueError, match="eps"):
        ring.lookup(1, {}, -0.1)
    with pytest.raises(ValueError, match="negative"):
        ring.lookup(1, {"http://a:1": -1}, 0.1)
    with pytest.raises(ValueError, match="64-bit"):
        ring.lookup(1 << 64, {}, 0.1)
    assert ring.workers == ("http://a:1",) and "http://a:1" in ring and len(ring) == 1


def test_zero_loads_lookup_is_plain_consistent_hashing():
    ring = HashRing(urls(5))
    for key in random_keys(500, seed=1):
        assert ring.lookup(key, {}, 0.25) == ring.owner(key)


# -- key movement ----------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(2, 32), salt=st.integers(0, 10**6), victim=st.integers(0, 31), key_seed=st.integers(0, 99))
def test_removing_one_of_n_moves_only_its_keys(n, salt, victim, key_seed):
    workers = urls(n, salt)
    ring = HashRing(workers)
    keys = random_keys(20_000, key_seed)
    before = [ring.lookup(k, {}, 0.25) for k in keys]
    gone = workers[victim % n]
    ring.remove(gone)
    after = [ring.lookup(k, {}, 0.25) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(b == gone for b, _ in moved)  # nobody else's keys move
    assert len(moved) / len(keys) <= 1 / n + 0.05


@SETTINGS
@given(n=st.integers(2, 32), salt=st.integers(0, 10**6), key_seed=st.integers(0, 99))
def test_adding_one_worker_moves_only_keys_to_it(n, salt, key_seed):
    workers = urls(n + 1, salt)
    ring = HashRing(workers[:n])
    keys = random_keys(20_000, key_seed)
    before = [ring.lookup(k, {}, 0.25) for k in keys]
    ring.add(workers[n])
    after = [ring.lookup(k, {}, 0.25) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == workers[n] for _, a in moved)
    assert len(moved) / len(keys) <= 1 / n + 0.05


# -- replicas agree --------------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data(), n=st.integers(1, 12), salt=st.integers(0, 10**6))
def test_rings_built_in_any_order_agree(data, n, salt):
    workers = urls(n, salt)
    shuffled = data.draw(st.permutations(workers))
    one = HashRing(workers, vnodes=64)
    other = HashRing(vnodes=64)
    for w in [*shuffled, "http://transient:1"]:
        other.add(w)
    other.remove("http://transient:1")
    rng = random.Random(salt)
    loads = {w: rng.randrange(0, 6) for w in workers}
    for key in random_keys(2_000, salt):
        assert one.owner(key) == other.owner(key)
        assert one.lookup(key, loads, 0.2) == other.lookup(key, loads, 0.2)
    assert one.points == other.points


# -- bounded loads ---------------------------------------------------------------------------------------


def key_stream(rng: random.Random, count: int, hot_share: float) -> list[int]:
    """`count` keys where one hot key makes up about hot_share of the stream, the rest uniform."""
    hot = rng.getrandbits(64)
    return [hot if rng.random() < hot_share else rng.getrandbits(64) for _ in range(count)]


@SETTINGS
@given(n=st.integers(2, 16), eps=st.floats(0.0, 1.0), hot_share=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
       seed=st.integers(0, 10**6))
def test_arrivals_never_push_a_worker_over_the_bound(n, eps, hot_share, seed):
    ring = HashRing(urls(n, seed), vnodes=128)
    rng = random.Random(seed)
    loads: collections.Counter = collections.Counter()
    keys = key_stream(rng, 400, hot_share)
    for placed, key in enumerate(keys, start=1):
        loads[ring.lookup(key, loads, eps)] += 1
        assert max(loads.values()) <= math.ceil((1 + eps) * placed / n)
    if hot_share == 1.0:
        # One key only: it fills the workers in its clockwise order, never jumping to a random one.
        assert set(loads) == set(list(ring.walk(keys[0]))[: len(loads)])


@SETTINGS
@given(n=st.integers(2, 16), eps=st.floats(0.0, 1.0), hot_share=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 10**6))
def test_placement_respects_the_bound_with_departures(n, eps, hot_share, seed):
    ring = HashRing(urls(n, seed), vnodes=128)
    rng = random.Random(seed)
    loads: collections.Counter = collections.Counter()
    in_flight: list[str] = []
    for key in key_stream(rng, 400, hot_share):
        while in_flight and rng.random() < 0.45:  # requests finish in random order
            loads[in_flight.pop(rng.randrange(len(in_flight)))] -= 1
        bound = math.ceil((1 + eps) * (sum(loads.values()) + 1) / n)
        chosen = ring.lookup(key, loads, eps)
        assert loads[chosen] + 1 <= bound
        # It is the first worker clockwise that had room: locality is given up only where the bound forces it.
        for earlier in ring.walk(key):
            if earlier == chosen:
                break
            assert loads[earlier] + 1 > bound
        loads[chosen] += 1
        in_flight.append(chosen)


@SETTINGS
@given(n=st.integers(2, 8), eps=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_weighted_requests_fit_when_possible_else_go_to_the_least_loaded(n, eps, seed):
    workers = urls(n, seed)
    ring = HashRing(workers, vnodes=64)
    rng = random.Random(seed)
    loads = {w: float(rng.randrange(0, 4000)) for w in workers}
    for key in random_keys(50, seed):
        weight = float(rng.choice([1, 50, 500, 5000]))
        bound = math.ceil((1 + eps) * (sum(loads.values()) + weight) / n)
        chosen = ring.lookup(key, loads, eps, weight=weight)
        fitting = [w for w in ring.walk(key) if loads[w] + weight <= bound]
        if fitting:
            assert chosen == fitting[0]
        else:
            assert loads[chosen] == min(loads.values())
        loads[chosen] += weight


# -- locality --------------------------------------------------------------------------------------------


def test_key_stays_on_its_worker_while_under_the_bound():
    ring = HashRing(urls(6), vnodes=256)
    rng = random.Random(3)
    for key in random_keys(300, seed=4):
        owner = ring.owner(key)
        loads = {w: rng.randrange(0, 10) for w in ring.workers}
        bound = ring.capacity(loads, 0.5)
        expected = owner if loads[owner] + 1 <= bound else next(w for w in ring.walk(key) if loads[w] + 1 <= bound)
        assert ring.lookup(key, loads, 0.5) == expected


@pytest.mark.parametrize("n, seed", [(4, 0), (8, 1), (8, 2), (16, 3)])
def test_hot_key_keeps_landing_on_the_same_worker(n, seed):
    """A steady stream with one moderately hot key (twice its fair share of traffic on its owner, here
    1/(2n) of all requests on top of the owner's 1/n of the rest) and eps = 1: the hot key is served by its
    owner nearly always, where a load-only policy would scatter it over all n workers."""
    ring = HashRing(urls(n, seed))
    rng = random.Random(seed)
    hot = rng.getrandbits(64)
    owner = ring.owner(hot)
    loads: collections.Counter = collections.Counter()
    in_flight: collections.deque = collections.deque()
    window = 20 * n  # requests in flight at steady state
    landed: collections.Counter = collections.Counter()
    for step in range(3_000):
        if len(in_flight) == window:
            loads[in_flight.popleft()] -= 1
        key = hot if rng.random() < 1 / (2 * n) else rng.getrandbits(64)
        chosen = ring.lookup(key, loads, eps=1.0)
        loads[chosen] += 1
        in_flight.append(chosen)
        if key == hot and step >= window:
            landed[chosen] += 1
    assert landed[owner] / sum(landed.values()) >= 0.9
    # Overflow goes to the next worker clockwise, not anywhere: at most the first two in the hot key's walk.
    assert set(landed) <= set(list(ring.walk(hot))[:2])
