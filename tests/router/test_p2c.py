"""Power of two choices for decode workers: health filtering, preference for the emptier worker, room."""

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.policies.p2c import DecodeWorkerState, PowerOfTwoChoices, decode_score, with_room

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)


@st.composite
def worker_states(draw, min_size=1, max_size=12):
    n = draw(st.integers(min_size, max_size))
    return [
        DecodeWorkerState(f"http://decode-{i}:8000", free_kv_blocks=draw(st.integers(0, 2000)),
                          running_seqs=draw(st.integers(0, 64)), healthy=draw(st.booleans()))
        for i in range(n)
    ]


@SETTINGS
@given(workers=worker_states(), seed=st.integers(0, 2**32))
def test_never_picks_an_unhealthy_worker(workers, seed):
    picker = PowerOfTwoChoices(random.Random(seed))
    healthy_urls = {w.url for w in workers if w.healthy}
    if not healthy_urls:
        with pytest.raises(LookupError):
            picker.pick(workers)
        return
    for _ in range(30):
        assert picker.pick(workers) in healthy_urls


@SETTINGS
@given(a_free=st.integers(0, 2000), a_running=st.integers(0, 64), b_free=st.integers(0, 2000),
       b_running=st.integers(0, 64), seed=st.integers(0, 2**32))
def test_of_two_candidates_the_emptier_wins(a_free, a_running, b_free, b_running, seed):
    a = DecodeWorkerState("http://a:1", a_free, a_running)
    b = DecodeWorkerState("http://b:1", b_free, b_running)
    sick = DecodeWorkerState("http://sick:1", 10_000, 0, healthy=False)  # would win on score if it were eligible
    picker = PowerOfTwoChoices(random.Random(seed))
    chosen = {picker.pick([sick, a, b]) for _ in range(5)}
    if decode_score(a) != decode_score(b):
        assert chosen == {max(a, b, key=decode_score).url}
    elif a_running != b_running:
        assert chosen == {min(a, b, key=lambda w: w.running_seqs).url}


def test_score_rewards_free_blocks_and_penalises_running_sequences():
    assert decode_score(DecodeWorkerState("u", 100, 0)) == 100
    assert decode_score(DecodeWorkerState("u", 100, 3)) == 25  # this request makes 4 sharing the headroom
    assert decode_score(DecodeWorkerState("u", 200, 3)) > decode_score(DecodeWorkerState("u", 100, 3))
    assert decode_score(DecodeWorkerState("u", 100, 1)) > decode_score(DecodeWorkerState("u", 100, 2))


@SETTINGS
@given(n=st.integers(3, 10), seed=st.integers(0, 2**32))
def test_the_worst_worker_is_never_picked_and_better_ones_are_favoured(n, seed):
    # Free blocks 100, 200, ... with equal batch sizes: scores strictly increase with the index.
    workers = [DecodeWorkerState(f"http://d{i}:1", 100 * (i + 1), 4) for i in range(n)]
    picker = PowerOfTwoChoices(random.Random(seed))
    counts = collections.Counter(picker.pick(workers) for _ in range(400))
    assert counts["http://d0:1"] == 0  # it loses against whichever worker it is sampled with
    # The best worker wins whenever sampled (about 2/n of picks); the second worst only against the worst.
    assert counts[f"http://d{n - 1}:1"] > counts["http://d1:1"]


def test_ties_spread_instead_of_herding():
    workers = [DecodeWorkerState(f"http://d{i}:1", 500, 2) for i in range(6)]
    picker = PowerOfTwoChoices(random.Random(7))
    assert len({picker.pick(workers) for _ in range(200)}) == 6


def test_prefers_workers_with_room_for_the_request():
    tight = DecodeWorkerState("http://tight:1", free_kv_blocks=10, running_seqs=0)  # best score, no room
    roomy = DecodeWorkerState("http://roomy:1", free_kv_blocks=40, running_seqs=7)
    picker = PowerOfTwoChoices(random.Random(0))
    assert picker.pick([tight, roomy]) == "http://tight:1"
    assert {picker.pick([tight, roomy], needed_blocks=20) for _ in range(20)} == {"http://roomy:1"}
    # When nobody has room, the request still goes somewhere (it waits or preempts there).
    assert picker.pick([tight, roomy], needed_blocks=100) == "http://tight:1"
    assert with_room([tight, roomy], 100) == [tight, roomy]


def test_same_seed_same_choices_whatever_the_listing_order():
    workers = [DecodeWorkerState(f"http://d{i}:1", 50 * i, i % 3) for i in range(8)]
    first = PowerOfTwoChoices(random.Random(11))
    second = PowerOfTwoChoices(random.Random(11))
    reordered = list(reversed(workers))
    assert [first.pick(workers) for _ in range(50)] == [second.pick(reordered) for _ in range(50)]


def test_single_healthy_worker_and_bad_input():
    only = DecodeWorkerState("http://only:1", 0, 30)
    assert PowerOfTwoChoices(random.Random(0)).pick([only]) == "http://only:1"
    with pytest.raises(ValueError, match="listed twice"):
        PowerOfTwoChoices().pick([only, only])
    with pytest.raises(ValueError, match="needed_blocks"):
        PowerOfTwoChoices().pick([only], needed_blocks=-1)
    with pytest.raises(ValueError, match="free_kv_blocks"):
        DecodeWorkerState("http://x:1", -1, 0)
    with pytest.raises(ValueError, match="running_seqs"):
        DecodeWorkerState("http://x:1", 1, -1)
    with pytest.raises(LookupError):
        PowerOfTwoChoices().pick([])
