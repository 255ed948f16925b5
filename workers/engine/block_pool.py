"""The pool of KV-cache blocks: reference counts, an LRU free list and the hash -> block index.

Modelled on vLLM v1's BlockPool; knows nothing about sequences (a lease is one more reference). The states of
a block: docs/design/engine.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Insertion order == freeing order: the first key is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks, least recently freed first (the order `allocate` hands them out)."""
        return list(self._free)

    def allocate(self) -> int:
        """Hand out the least recently freed block with one reference; it loses any hash."""
        if not self._free:
            raise RuntimeError("no free KV blocks")
        block_id, _ = self._free.popitem(last=False)
        self._evict_hash(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def ref(self, block_id: int) -> None:
        """Add a reference; a free block (a prefix-cache hit) leaves the free list, keeping its hash."""
        if self.ref_counts[block_id] == 0:
            del self._free[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop a reference; at zero the block becomes the most recently freed one."""
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than referenced")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self._free[block_id] = None

    def free_all(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.free(block_id)

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the content with this hash, in use or free, if any."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Make a full, computed block findable by its hash.

        Two sequences can fill blocks with the same content at once; the first one registered
        stays the canonical copy and the other remains private (returns False).
        """
        if self.block_hash[block_id] is not None:
            return self.block_hash[block_id] == block_hash
        if block_hash in self._cached:
            return False
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after weights change); blocks in use keep their content."""
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks

    def reset(self) -> None:
        """Back to the state of a new pool: every block free, in id order, and no hashes. Only while none is in use
        (the engine's start-up calibration leaves it so)."""
        if any(self.ref_counts):
            raise RuntimeError("cannot reset a block pool with blocks in use")
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self.reset_prefix_cache()

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
