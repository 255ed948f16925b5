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


# Leases their holders released, remembered (the newest this many) to answer a holder that asks again alike.
REMEMBERED_RELEASES = 4096


class LeaseTable:
    def __init__(self, pool: BlockPool, ttl_s: float, clock: Callable[[], float] = time.time):
        self.pool = pool
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, KVLease] = {}
        self._released_by_holder: dict[str, None] = {}  # insertion-ordered: the oldest go first
        self.num_pinned_blocks = 0
        self.num_expired = 0

    def pin(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVLease:
        for block_id in block_ids:
            self.pool.ref(block_id)
        lease = KVLease(uuid.uuid4().hex, request_id, list(block_ids), num_tokens, self.clock() + self.ttl_s)
        self._leases[lease.lease_id] = lease
        self.num_pinned_blocks += len(block_ids)
        return lease

    def release(self, lease_id: str, by_holder: bool = False) -> bool:
        """Drop a lease; False when it is unknown, already released or expired. A release `by_holder` (the decode
        worker the handle went to, done reading) is remembered, and its holder asking again is answered True
        again: it asks again when its first ask timed out while waiting for a long engine step here, and that
        ask, carried out after the step, is what released the lease (it held until then). Told False instead,
        the holder would throw away a read that was good."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return by_holder and lease_id in self._released_by_holder
        self.pool.free_all(reversed(lease.block_ids))
        self.num_pinned_blocks -= len(lease.block_ids)
        if by_holder:
            self._released_by_holder[lease_id] = None
            if len(self._released_by_holder) > REMEMBERED_RELEASES:
                del self._released_by_holder[next(iter(self._released_by_holder))]
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

    def __len__(self) -> int:
        return len(self._leases)
