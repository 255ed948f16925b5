"""Continuous-batching scheduler: budgets, chunking, decode-first, FCFS, preemption, abort, no leaks."""

from __future__ import annotations

import random

import pytest

from tandem.hashing import model_seed
from tandem.protocol import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.scheduler import Scheduler, SchedulerOutput
from tandem.workers.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=32, prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, model_seed("sched-test"), enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


_next_token = iter(range(10_000, 10**9))


def add(sched: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4, arrival: float | None = None,
        first_token: int | None = None) -> Sequence:
    base = next(_next_token) * 1000 if first_token is None else first_token
    seq = Sequence(request_id, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival)
    sched.add(seq)
    return seq


def complete_step(sched: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Play the engine's part: the tokens were computed; sample a dummy token where the sequence is complete."""
    finished = []
    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        sched.block_manager.cache_computed_blocks(seq)
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                finished.append(seq)
    return finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return outs
        out = sched.schedule()
        outs.append(out)
        complete_step(sched, out)
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_splits_long_prompt_over_steps():
    sched = make(budget=16)
    seq = add(sched, "long", 50, max_tokens=2)
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        assert out.seqs == [seq]
        chunks.append(out.num_new_tokens[0])
        complete_step(sched, out)
        if chunks[-1] < 16:
            break
    assert chunks == [16, 16, 16, 2]
    assert seq.num_output_tokens == 1, "a token is sampled only once the prompt is complete"


def test_budget_and_max_num_seqs_hold_under_random_load():
    rng = random.Random(0)
    sched = make(num_blocks=48, max_num_seqs=5, budget=24)
    for i in range(40):
        add(sched, f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 12))
    outs = run_to_completion(sched)
    for out in outs:
        assert 0 < out.total_tokens <= 24
        assert len(out.seqs) <= 5
        assert len(set(map(id, out.seqs))) == len(out.seqs)
    assert sched.block_manager.num_used_blocks == 0, "no block leaks once every request finished"


def test_decodes_go_first_and_prefill_takes_the_rest():
    sched = make(budget=10)
    decoding = [add(sched, f"d{i}", 3, max_tokens=50) for i in range(3)]
    complete_step(sched, sched.schedule())  # all three prefill in one step (9 tokens)
    assert all(s.num_uncomputed_tokens == 1 for s in decoding)
    longp = add(sched, "prefill", 30)
    out = sched.schedule()
    assert out.seqs[:3] == decoding and out.num_new_tokens[:3] == [1, 1, 1]
    assert out.seqs[3] is longp and out.num_new_tokens[3] == 7
    complete_step(sched, out)
    # Next step: decodes first, then the continuing chunk, before any new admission.
    late = add(sched, "late", 5)
    out = sched.schedule()
    assert out.seqs == [*decoding, longp] and out.num_new_tokens == [1, 1, 1, 7]
    assert late.status is SequenceStatus.WAITING


def test_fcfs_head_of_line_is_not_overtaken():
    sched = make(num_blocks=6, budget=64)
    add(sched, "a", 12, max_tokens=4)  # 3 blocks (+1 later)
    big = add(sched, "big", 16, max_tokens=4)  # needs 4 blocks: does not fit next to a
    small = add(sched, "small", 2, max_tokens=1)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"]
    assert list(sched.waiting) == [big, small], "small must not jump ahead of big"


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2, budget=100)
    for i in range(4):
        add(sched, f"r{i}", 3)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["r0", "r1"]
    assert len(sched.waiting) == 2


def test_preemption_picks_latest_arrival_and_requeues_it_at_the_head():
    sched = make(num_blocks=4, budget=64)
    early = add(sched, "early", 4, max_tokens=10, arrival=1.0)
    late = add(sched, "late", 4, max_tokens=10, arrival=2.0)
    # Steps 1-5 fill two blocks each; at step 6 both need a third and only one can have it.
    for _ in range(5):
        out = sched.schedule()
        assert out.seqs == [early, late] and not out.preempted
        complete_step(sched, out)
    newcomer = add(sched, "newcomer", 1, max_tokens=1, arrival=3.0)
    out = sched.schedule()
    assert out.preempted == [late], "the latest-arrived running sequence is the victim"
    assert out.seqs == [early]
    assert out.admitted == [], "no admission in a step that preempted, though a block is free"
    assert list(sched.waiting) == [late, newcomer], "the victim goes back to the head of the queue"
    assert late.status is SequenceStatus.WAITING
    assert late.block_table == [] and late.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and late.num_preemptions == 1
    assert sched.block_manager.num_used_blocks == 3
    complete_step(sched, out)
    run_to_completion(sched)
    assert late.num_output_tokens == 10 and early.num_output_tokens == 10
    assert sched.block_manager.num_used_blocks == 0, "no block leaks after preemption"


def test_preempting_an_already_scheduled_victim_refunds_its_tokens():
    sched = make(num_blocks=6, budget=8, prefix_caching=False)
    # Queue order and arrival order differ: "late" is admitted first but arrived last.
    late = add(sched, "late", 3, max_tokens=10, arrival=2.0)
    early = add(sched, "early", 20, max_tokens=2, arrival=1.0)
    out = sched.schedule()
    assert out.seqs == [late, early] and out.num_new_tokens == [3, 5]
    complete_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [late, early] and out.num_new_tokens == [1, 7]
    complete_step(sched, out)
    # Now the decode (late) is scheduled first and takes a block; early's chunk then needs two
    # with one left, so late - already scheduled - is the victim and gives its token back.
    out = sched.schedule()
    assert out.preempted == [late]
    assert out.seqs == [early] and out.num_new_tokens == [7]
    assert late.block_table == [] and sched.block_manager.num_used_blocks == 5


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_latest():
    sched = make(num_blocks=2, budget=64)
    only = add(sched, "only", 3, max_tokens=10, arrival=1.0)
    other = add(sched, "other", 4, max_tokens=10, arrival=2.0)
    complete_step(sched, sched.schedule())
    out = sched.schedule()  # "other" needs a second block, "only" does not yet
    assert out.preempted == [other] and out.seqs == [only]
    assert sched.waiting[0] is other


def test_recompute_after_preemption_covers_prompt_and_output():
    sched = make(num_blocks=4, budget=64, prefix_caching=False)
    a = add(sched, "a", 4, max_tokens=12, arrival=1.0)
    b = add(sched, "b", 4, max_tokens=12, arrival=2.0)
    preempted_at = None
    for _ in range(30):
        out = sched.schedule()
        if b in out.preempted:
            preempted_at = b.num_tokens
        if preempted_at and b in out.seqs and b.num_computed_tokens == 0:
            i = out.seqs.index(b)
            assert out.num_new_tokens[i] == b.num_tokens, "recompute prefills prompt + output so far"
            break
        complete_step(sched, out)
    assert preempted_at is not None
    run_to_completion(sched)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12


def test_readmission_hits_own_cached_blocks_after_preemption():
    sched = make(num_blocks=5, budget=64)
    a = add(sched, "a", 8, max_tokens=4, arrival=1.0)
    b = add(sched, "b", 8, max_tokens=12, arrival=2.0)
    complete_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [b]
    hits_before = sched.block_manager.num_hit_tokens
    complete_step(sched, out)
    for _ in range(10):
        out = sched.schedule()
        if b in out.admitted:
            break
        complete_step(sched, out)
    else:
        pytest.fail("b was not readmitted")
    assert a.is_finished
    # Its own two full prompt blocks survived in the free list: only the sampled token is recomputed. They are no
    # prompt tokens served from the cache, though: usage and the hit metrics count its first admission (none).
    assert out.num_new_tokens[out.seqs.index(b)] == 1, "only the sampled token is recomputed"
    assert b.num_cached_tokens == 0 and sched.block_manager.num_hit_tokens == hits_before
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0
    assert b.num_output_tokens == 12


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make(num_blocks=8, max_num_seqs=1, budget=64)
    running = add(sched, "run", 10, max_tokens=5)
    waiting = add(sched, "wait", 10, max_tokens=5)
    complete_step(sched, sched.schedule())
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort("wait") is waiting
    assert waiting.status is SequenceStatus.FINISHED and waiting.finish_reason == "abort"
    assert sched.abort("run") is running
    assert sched.block_manager.num_used_blocks == 0
    assert sched.num_unfinished == 0
    assert sched.abort("run") is None and sched.abort("nope") is None
    assert not sched.schedule()


def test_prefix_hit_costs_no_budget():
    sched = make(budget=64)
    shared = list(range(500, 520))
    first = Sequence("first", shared + [1, 2], SamplingParams(max_tokens=1))
    sched.add(first)
    run_to_completion(sched)
    second = Sequence("second", shared + [3, 4, 5], SamplingParams(max_tokens=1))
    sched.add(second)
    out = sched.schedule()
    assert out.seqs == [second] and out.num_new_tokens == [23 - 20]
    assert second.num_cached_tokens == 20


def test_constructor_validates_limits():
    bm = BlockManager(4, BS, 0)
    with pytest.raises(ValueError):
        Scheduler(bm, max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=0)


def test_while_others_run_a_request_holding_its_blocks_does_not_pass_one_ahead_of_it():
    """Requests whose KV was imported (blocks held while waiting) go first only when nothing runs (the livelock
    tests/workers/test_engine_pd.py shows); while others run, order is kept, so that one given way (preempted) or simply
    earlier is not passed for good by pulled requests arriving behind it (found by a review helper)."""
    sched = make(num_blocks=64, max_num_seqs=2, budget=64)
    running = add(sched, "running", 4, max_tokens=50)
    complete_step(sched, sched.schedule())
    earlier = add(sched, "earlier", 8)
    imported = add(sched, "imported", 8)
    assert sched.block_manager.allocate_slots(imported, 9)  # its pulled prompt and first token's slot
    imported.num_computed_tokens = 8
    imported.append_token(7)
    out = sched.schedule()
    assert out.admitted == [earlier] and running in out.seqs


def test_when_nothing_runs_a_request_holding_its_blocks_goes_first():
    sched = make(num_blocks=64, max_num_seqs=1, budget=64)
    add(sched, "earlier", 8)
    imported = add(sched, "imported", 8)
    assert sched.block_manager.allocate_slots(imported, 9)
    imported.num_computed_tokens = 8
    imported.append_token(7)
    assert [s.request_id for s in sched.schedule().admitted] == ["imported"]


def shared_prefix_pair(sched: Scheduler, prefix_blocks: int = 4, suffix: int = 2) -> tuple[Sequence, Sequence]:
    """Two requests behind one new prefix of prefix_blocks full blocks, each with a suffix of its own."""
    base = next(_next_token) * 1000
    prefix = list(range(base, base + prefix_blocks * BS))
    first = Sequence("first", prefix + [1, 2][:suffix], SamplingParams(max_tokens=2))
    second = Sequence("second", prefix + [3, 4][:suffix], SamplingParams(max_tokens=2))
    sched.add(first)
    sched.add(second)
    return first, second


def test_a_request_behind_a_prefix_being_computed_waits_for_it_instead_of_computing_it_again():
    sched = make(budget=64)
    first, second = shared_prefix_pair(sched)
    out = sched.schedule()
    assert out.seqs == [first], "the second would compute the same 4 blocks in the same step"
    complete_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [first, second] and out.num_new_tokens == [1, 2], "4 blocks cached: only its own 2 tokens"
    assert second.num_cached_tokens == 4 * BS
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0 and not sched.block_manager._computing


def test_it_waits_over_a_chunked_prefill_and_others_go_meanwhile():
    sched = make(budget=3 * BS)  # the first request's 18 tokens take it two steps
    first, second = shared_prefix_pair(sched)
    other = add(sched, "other", BS)
    out = sched.schedule()
    assert out.seqs == [first] and out.num_new_tokens == [3 * BS]
    complete_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [first, other], "block 3 is still being computed: the second waits, the budget left goes on"
    complete_step(sched, out)
    out = sched.schedule()
    assert second in out.seqs and out.num_new_tokens[out.seqs.index(second)] == 2
    assert second.num_cached_tokens == 4 * BS
    run_to_completion(sched)


def test_a_request_not_behind_it_is_not_held_back():
    sched = make(budget=64)
    first, _ = shared_prefix_pair(sched, suffix=0)
    unrelated = add(sched, "unrelated", 3 * BS)
    out = sched.schedule()
    assert out.seqs == [first, unrelated]


@pytest.mark.parametrize("how", ["abort", "abort, blocks kept", "preempt"])
def test_when_the_one_computing_it_stops_the_waiting_request_computes_it(how):
    sched = make(budget=2 * BS)
    first, second = shared_prefix_pair(sched)
    complete_step(sched, sched.schedule())  # blocks 0-1 computed, 2-3 announced
    if how == "preempt":
        sched._preempt(first)
        sched.waiting.remove(first)  # out of the way: what matters is that its announcement is withdrawn
    else:
        sched.abort("first", free_blocks=how == "abort")
    out = sched.schedule()
    assert out.seqs == [second] and second.num_cached_tokens == 2 * BS


def test_a_request_wanting_prompt_logprobs_never_waits_since_it_cannot_use_the_cache():
    sched = make(budget=64)
    first, second = shared_prefix_pair(sched)
    second.prompt_logprobs = []
    out = sched.schedule()
    assert out.seqs == [first, second]


@pytest.mark.parametrize("seed", range(6))
def test_random_bursts_behind_shared_prefixes_always_drain_and_leave_nothing_announced(seed):
    """Requests behind a few shared prefixes arrive in bursts into a pool tight enough to preempt, some are aborted
    mid-way (their blocks freed or kept) and some want prompt logprobs: every request still finishes (a request
    never waits for a block nobody computes), no block leaks, nothing stays announced."""
    rng = random.Random(seed)
    sched = make(num_blocks=16, max_num_seqs=6, budget=rng.choice([12, 16, 40]))
    prefixes: list[list[int]] = []
    kept: list[Sequence] = []  # aborted with their blocks kept, as the engine does while a pull writes into them
    added = waits = 0
    announced = sched.block_manager.waits_for_a_block_being_computed

    def counted(seq, hits):  # how often a request waited, so that the test shows it exercised that
        nonlocal waits
        waiting = announced(seq, hits)
        waits += waiting
        return waiting

    sched.block_manager.waits_for_a_block_being_computed = counted
    for _ in range(400):
        if added < 40 and rng.random() < 0.3:
            if not prefixes or rng.random() < 0.5:  # a burst behind a new prefix, or one seen before
                prefixes.append([rng.randrange(50_000, 90_000) for _ in range(rng.randint(1, 5) * BS)])
            prefix = rng.choice(prefixes)
            for _ in range(min(rng.randint(2, 5), 40 - added)):
                prompt = prefix + [rng.randrange(1000) for _ in range(rng.randint(0, 9))]
                seq = Sequence(f"r{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)))
                if rng.random() < 0.15:
                    seq.prompt_logprobs = []
                sched.add(seq)
                added += 1
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running)
            keep = rng.random() < 0.5
            sched.abort(victim.request_id, free_blocks=not keep)
            if keep:
                kept.append(victim)
        if kept and rng.random() < 0.3:  # the pull writing into them is over
            sched.block_manager.free(kept.pop(0))
        if not sched.num_unfinished and added >= 40:
            break
        complete_step(sched, sched.schedule())
    for seq in kept:
        sched.block_manager.free(seq)
    run_to_completion(sched)
    assert added == 40 and waits > 0 and sched.num_preemptions > 0, (waits, sched.num_preemptions)
    assert sched.block_manager.num_used_blocks == 0
    assert not sched.block_manager._computing
