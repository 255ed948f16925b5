"""KV block pool and prefix-cache bookkeeping: reference counts, LRU reuse, hits, no leaks."""

from __future__ import annotations

import pytest

from tandem.hashing import block_hashes, model_seed
from tandem.protocol import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.block_pool import BlockPool
from tandem.workers.engine.sequence import Sequence

SEED = model_seed("test-model")
BS = 4


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8))


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> bool:
    hits = bm.find_cached_prefix(seq)
    if num_new is None:
        num_new = seq.num_tokens - len(hits) * BS
    return bm.allocate_slots(seq, num_new, prefix_blocks=hits)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after a forward pass over num_tokens more tokens of seq."""
    seq.num_computed_tokens += num_tokens
    bm.cache_computed_blocks(seq)


# ------------------------------------------------------------------ BlockPool


def test_pool_reference_counts():
    pool = BlockPool(4)
    a = pool.allocate()
    assert pool.ref_counts[a] == 1 and pool.num_used == 1
    pool.ref(a)
    assert pool.ref_counts[a] == 2
    pool.free(a)
    assert pool.num_used == 1, "still referenced once"
    pool.free(a)
    assert pool.num_used == 0 and pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a)


def test_pool_reuses_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        pool.allocate()
    for b in (blocks[1], blocks[2], blocks[0]):
        pool.free(b)
    assert pool.free_block_ids() == [blocks[1], blocks[2], blocks[0]]
    assert [pool.allocate() for _ in range(3)] == [blocks[1], blocks[2], blocks[0]]


def test_free_cached_block_is_findable_until_reused():
    pool = BlockPool(2)
    a = pool.allocate()
    assert pool.cache_block(a, 1234)
    pool.free(a)
    assert pool.lookup(1234) == a, "a free cached block keeps its hash"
    pool.ref(a)  # a prefix hit revives it out of the free list
    assert pool.num_free == 1 and pool.lookup(1234) == a
    pool.free(a)
    b = pool.allocate()  # the never-used block was freed earlier (at start), so it goes first
    assert b != a and pool.lookup(1234) == a
    c = pool.allocate()
    assert c == a and pool.lookup(1234) is None, "reuse evicts the hash"
    assert pool.block_hash[c] is None


def test_duplicate_content_keeps_first_copy_canonical():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert pool.lookup(7) == a
    pool.free(b)
    pool.allocate()  # reusing the un-registered duplicate must not evict a's entry
    pool.allocate()
    assert pool.lookup(7) == a


# ------------------------------------------------------------------ BlockManager


def test_allocates_blocks_for_prompt_and_caches_them_as_they_fill():
    bm = BlockManager(16, BS, SEED)
    tokens = list(range(10))
    seq = make_seq(tokens)
    assert admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.num_queried_tokens == 10 and bm.num_hit_tokens == 0
    compute(bm, seq, 10)
    expected = block_hashes(tokens, BS, SEED)
    assert seq.block_hashes == expected
    assert [bm.pool.lookup(h) for h in expected] == seq.block_table[:2]
    assert bm.pool.block_hash[seq.block_table[2]] is None, "the partial block is not cached"


def test_decode_fills_and_caches_blocks():
    bm = BlockManager(16, BS, SEED)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    admit(bm, seq)
    compute(bm, seq, 6)
    for token in (7, 8):  # one decode per step: allocate a slot for the sampled token, then compute it
        seq.append_token(token)
        assert bm.allocate_slots(seq, 1)
        compute(bm, seq, 1)
    h = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, SEED)
    assert bm.pool.lookup(h[1]) == seq.block_table[1]
    seq.append_token(9)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 3, "the 9th token opens a third block"


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(32, BS, SEED)
    first = make_seq(list(range(100, 122)), "a")  # 22 tokens: 5 full blocks
    admit(bm, first)
    compute(bm, first, 22)
    second = make_seq(list(range(100, 114)) + [7, 7, 7, 7, 7, 7], "b")  # shares 14 tokens: 3 full blocks
    assert admit(bm, second)
    assert second.block_table[:3] == first.block_table[:3]
    assert second.num_computed_tokens == 12 and second.num_cached_tokens == 12
    assert all(bm.pool.ref_counts[b] == 2 for b in first.block_table[:3])
    assert bm.num_queried_tokens == 22 + 20 and bm.num_hit_tokens == 12
    assert len(second.block_table) == 5


def test_hash_chain_requires_identical_prefix():
    bm = BlockManager(32, BS, SEED)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    admit(bm, a)
    compute(bm, a, 9)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # same second block, different first one
    assert bm.find_cached_prefix(b) == []


@pytest.mark.parametrize("length, expected_hit_blocks", [(8, 1), (9, 2), (12, 2), (4, 0), (5, 1)])
def test_never_counts_whole_prompt_as_hit(length, expected_hit_blocks):
    bm = BlockManager(32, BS, SEED)
    tokens = list(range(50, 50 + 12))
    owner = make_seq(tokens, "owner")
    admit(bm, owner)
    compute(bm, owner, 12)
    seq = make_seq(tokens[:length], "again")
    hits = bm.find_cached_prefix(seq)
    assert len(hits) == expected_hit_blocks
    assert admit(bm, seq)
    assert seq.num_uncomputed_tokens >= 1, "at least the last prompt token is computed for its logits"


def test_failed_allocation_changes_nothing():
    bm = BlockManager(4, BS, SEED)
    owner = make_seq(list(range(8)), "owner")
    admit(bm, owner)
    compute(bm, owner, 8)
    bm.free(owner)  # its 2 cached blocks are free but findable
    greedy_seq = make_seq(list(range(8)) + list(range(100, 112)), "big")  # 20 tokens: needs 5 blocks
    hits = bm.find_cached_prefix(greedy_seq)
    assert len(hits) == 2
    before = (bm.pool.free_block_ids(), list(bm.pool.ref_counts))
    assert not bm.allocate_slots(greedy_seq, 12, prefix_blocks=hits)
    assert (bm.pool.free_block_ids(), list(bm.pool.ref_counts)) == before
    assert greedy_seq.block_table == [] and greedy_seq.num_computed_tokens == 0
    assert bm.num_queried_tokens == 8, "a failed admission is not counted"
    # Reviving the two free cached hits costs free blocks too: 2 hits + 2 new = 4 fits.
    fits = make_seq(list(range(8)) + list(range(100, 108)), "fits")
    assert admit(bm, fits) and bm.num_free_blocks == 0


def test_hit_blocks_are_not_evicted_by_the_same_allocation():
    bm = BlockManager(3, BS, SEED)
    owner = make_seq(list(range(8)), "owner")
    admit(bm, owner)
    compute(bm, owner, 8)
    owner_table = list(owner.block_table)
    other = make_seq([9, 9, 9], "other")
    admit(bm, other)
    other_block = other.block_table[0]
    bm.free(owner)
    bm.free(other)  # free list: owner's blocks first, so a naive allocation would take a hit block
    seq = make_seq(list(range(8)) + [5, 5, 5], "s")
    assert admit(bm, seq)
    assert seq.block_table == owner_table + [other_block]
    assert bm.pool.lookup(block_hashes(list(range(8)), BS, SEED)[1]) == owner_table[1]


def test_free_releases_tail_first_so_shared_prefix_survives_longest():
    bm = BlockManager(8, BS, SEED)
    seq = make_seq(list(range(12)))
    admit(bm, seq)
    table = list(seq.block_table)
    compute(bm, seq, 12)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_used_blocks == 0
    free_order = bm.pool.free_block_ids()
    assert free_order[-3:] == table[::-1]


def test_shared_blocks_stay_used_until_last_holder_frees():
    bm = BlockManager(16, BS, SEED)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    compute(bm, a, 9)
    b = make_seq(list(range(9)), "b")
    admit(bm, b)
    assert bm.num_used_blocks == 3 + 1
    bm.free(a)
    assert bm.num_used_blocks == 3, "b still holds the two shared blocks and its own"
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_prefix_caching_disabled():
    bm = BlockManager(16, BS, SEED, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    admit(bm, a)
    compute(bm, a, 9)
    assert bm.pool.num_cached == 0
    b = make_seq(list(range(9)), "b")
    assert bm.find_cached_prefix(b) == []
    admit(bm, b)
    assert b.num_cached_tokens == 0 and bm.num_hit_tokens == 0


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS, SEED)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, SEED)
