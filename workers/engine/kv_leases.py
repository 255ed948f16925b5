"""Leases on a finished prefill's KV blocks, held for the decode worker that will pull them.

A lease is one more reference on each block, so the blocks cannot be reused while a pull may
still read them. It ends when the decode worker releases it or when its TTL runs out, whichever
comes first; either way the references drop and the blocks go back to the pool (full ones stay
findable in the prefix cache). No path keeps a block pinned forever.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tandem.workers.engine.block_pool import BlockPool


@dataclass
class KVLease:
    lease_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float  # unix time, so that another process can read it


# Leases released after their holder's read, remembered (the newest this many) to answer a repeated ask alike.
REMEMBERED_RELEASES = 4096


class LeaseTable:
    def __init__(self, pool: BlockPool, ttl_s: float, clock: Callable[[], float] = time.time):
        self.pool = pool
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, KVLease] = {}
        self._released_after_read: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self.num_pinned_blocks = 0
        self.num_expired = 0

    def pin(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVLease:
        for block_id in block_ids:
            self.pool.ref(block_id)
        lease = KVLease(uuid.uuid4().hex, request_id, list(block_ids), num_tokens, self.clock() + self.ttl_s)
        self._leases[lease.lease_id] = lease
        self.num_pinned_blocks += len(block_ids)
        return lease

    def release(self, lease_id: str, after_read: bool = False) -> bool:
        """Drop a lease; False when it is unknown, already released or expired. A release `after_read` (sent by the
        decode worker whose read of the blocks is over) is remembered, and the same ask again is answered True
        again: it comes again when the first timed out while waiting for a long engine step here, and that first
        ask, carried out after the step, is what released the lease, which held until then. Told False instead,
        the decode worker would throw away a read that was good. Any other release (a decode request given up
        while its read may still be on, an abort, an expiry) is not remembered: the blocks may be reused under a
        read still going on, whose own release must then be told False."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return after_read and lease_id in self._released_after_read
        self.pool.free_all(reversed(lease.block_ids))
        self.num_pinned_blocks -= len(lease.block_ids)
        if after_read:
            self._released_after_read[lease_id] = None
            if len(self._released_after_read) > REMEMBERED_RELEASES:
                del self._released_after_read[next(iter(self._released_after_read))]
        return True

    def release_request(self, request_id: str) -> bool:
        """Drop the lease a request's prefill left; False when it has none."""
        lease_id = next((lid for lid, lease in self._leases.items() if lease.request_id == request_id), None)
        return lease_id is not None and self.release(lease_id)

    def expire(self) -> int:
        """Release every lease whose TTL has run out; returns how many."""
        now = self.clock()
        expired = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        self.num_expired += len(expired)
        return len(expired)

    def covers(self, lease_id: str, block_ids: list[int]) -> bool:
        """Whether a live lease of that id holds every one of block_ids (the TCP KV server's check). Called from
        the server's threads: one dict lookup, and a lease's block list never changes once pinned."""
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at > self.clock() and set(block_ids) <= set(lease.block_ids)

    def __len__(self) -> int:
        return len(self._leases)
