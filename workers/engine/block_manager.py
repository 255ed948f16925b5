"""Sequence-level KV block management with prefix caching (vLLM v1's KVCacheManager, small).

Shares a new sequence's cached leading blocks, registers blocks under their chained hash once computed, and
announces blocks being computed so requests behind one new prefix wait for it: docs/design/engine.md.
"""

from __future__ import annotations

from tandem.hashing import block_hashes
from tandem.workers.engine.block_pool import BlockPool
from tandem.workers.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        # Cumulative prefix-cache counters, in tokens, counted once per admission.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Block hash -> the running sequence that will compute that block (admitted, not yet computed).
        self._computing: dict[int, Sequence] = {}
        # benchmarks/prefix_burst.py turns this off to measure what waiting for a block being computed saves.
        self.wait_for_blocks_being_computed = True

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`'s tokens; changes nothing.

        At least one token is always left to compute, because sampling needs the logits of
        the last one: a prompt that is entirely cached still recomputes its last block.
        """
        if not self._can_use_cache(seq):
            return []
        self._extend_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def waits_for_a_block_being_computed(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether `seq`'s first block after its cached prefix `hits` is being computed by another sequence now:
        held back until that one has computed it, `seq` finds it cached rather than computing it a second time
        (the owner's prefill goes on in every step, before admissions, so the wait is a step or a few)."""
        if not self._computing or not self.wait_for_blocks_being_computed or not self._can_use_cache(seq):
            return False
        i = len(hits)
        if i >= min((seq.num_tokens - 1) // self.block_size, len(seq.block_hashes)):
            return False  # nothing left that a cache hit could cover (see find_cached_prefix)
        owner = self._computing.get(seq.block_hashes[i])
        return owner is not None and owner is not seq

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Give `seq` room for its next `num_new_tokens` tokens; False (and no change) if the pool is short.

        `prefix_blocks` is given at admission only: the result of `find_cached_prefix`, shared
        and counted as computed. Admissions update the queried/hit counters.
        """
        hits = prefix_blocks or []
        num_hit_tokens = len(hits) * self.block_size
        num_tokens_after = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = self.blocks_for(num_tokens_after) - len(seq.block_table) - len(hits)
        # A hit on a free cached block takes it out of the free list as surely as an allocation.
        num_revived = sum(1 for block_id in hits if self.pool.ref_counts[block_id] == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free:
            return False
        # Reference the hits before allocating, so allocation cannot evict one of them.
        for block_id in hits:
            self.pool.ref(block_id)
        if prefix_blocks is not None:
            seq.block_table.extend(hits)
            seq.num_computed_tokens += num_hit_tokens
            seq.num_cached_blocks = len(seq.block_table)
            if not seq.num_preemptions:
                # At its first admission only, as vLLM counts: a preempted request that comes back finds the
                # blocks it computed itself (its output's too), no prompt tokens served from the cache.
                seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
                self.num_queried_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += seq.num_cached_tokens
        for _ in range(num_new_blocks):
            seq.block_table.append(self.pool.allocate())
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are now full and computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        if len(seq.block_hashes) < num_full:
            self._extend_hashes(seq)
        table, hashes, pool, computing = seq.block_table, seq.block_hashes, self.pool, self._computing
        for i in range(seq.num_cached_blocks, num_full):
            pool.cache_block(table[i], hashes[i])
            if computing and computing.get(hashes[i]) is seq:
                del computing[hashes[i]]
        seq.num_cached_blocks = num_full

    def announce_computing(self, seq: Sequence) -> None:
        """`seq` was just admitted to compute its uncached full blocks: requests behind the same prefix wait for
        them (waits_for_a_block_being_computed). The scheduler calls this, not allocate_slots: blocks that a KV pull
        is to fill are not announced, since a pull may be queued behind another for a long while, and a request
        computes its prefix sooner than it waits for that."""
        if self.enable_prefix_caching:
            self._extend_hashes(seq)
            for block_hash in seq.block_hashes[seq.num_cached_blocks:]:
                self._computing.setdefault(block_hash, seq)

    def stop_computing(self, seq: Sequence) -> None:
        """Withdraw what `seq` announced it would compute (it finished, was aborted or preempted), so that no
        request waits for blocks nobody computes."""
        if self._computing:
            for block_hash in seq.block_hashes[seq.num_cached_blocks:]:
                if self._computing.get(block_hash) is seq:
                    del self._computing[block_hash]

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` at once (finish, abort, preemption).

        Freed tail first: the tail is the least likely to be shared, so it is reused first
        and the common prefix stays cached longest.
        """
        self.stop_computing(seq)
        self.pool.free_all(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past those `seq`'s known tokens need: the room of drafted tokens it rejected."""
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free_all(reversed(seq.block_table[keep:]))
            del seq.block_table[keep:]

    def _can_use_cache(self, seq: Sequence) -> bool:
        # Prompt logprobs need the logits of every prompt position not yet recorded: those are computed.
        return self.enable_prefix_caching and (seq.prompt_logprobs is None
                                               or len(seq.prompt_logprobs) >= seq.num_prompt_tokens)

    def _extend_hashes(self, seq: Sequence) -> None:
        known = seq.block_hashes
        if len(known) < seq.num_tokens // self.block_size:
            seed = self.hash_seed if seq.hash_seed is None else seq.hash_seed  # a LoRA adapter's own
            known.extend(block_hashes(seq.token_ids, self.block_size, seed,
                                      start=len(known), parent=known[-1] if known else None))
