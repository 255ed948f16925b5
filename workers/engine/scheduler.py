"""Continuous batching: which sequences compute how many tokens in the next forward pass.

Per step: decodes (with their drafted tokens, when speculating), then continuing prefills (chunked), then
admissions within the token budget; preemption by recompute when blocks run out, drafts dropped first. The order
and its rules: docs/design/engine.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # first scheduled since arrival or preemption

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_loras: int | None = None  # distinct adapters the running sequences may use (None: no LoRA)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}  # insertion-ordered: decodes, then prefills, then admissions

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens != 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            while not self.block_manager.allocate_slots(seq, num_tokens):
                if num_tokens > seq.num_uncomputed_tokens:  # its drafts go before anyone is preempted
                    num_tokens = seq.num_uncomputed_tokens
                    continue
                victim = max(self.running, key=_arrival_order)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = num_tokens
                budget -= num_tokens

        if not out.preempted:
            # First come, first served, with two exceptions for requests that already hold their prompt's blocks
            # (KV imported from a prefill worker while they waited, or kept for a recompute after a failed pull),
            # since only running them gives those blocks back. Once a request does not fit, those behind it that
            # hold blocks may still go. And when nothing runs, they go first: a request ahead of them that fits
            # only a chunk at a time would otherwise take the step's budget, find no room to go on, give way and
            # come back, step after step. (While others run, order is kept: a request given way is not passed
            # for good by pulled ones arriving behind it.)
            blocked = False
            queue = self.waiting if self.running else sorted(self.waiting, key=lambda s: not s.block_table)
            adapters = {s.lora for s in self.running if s.lora is not None}
            for seq in list(queue):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if seq.kv_source is not None:  # its prompt's KV is on the way (or waits for room to land)
                    continue
                if blocked and not seq.block_table:
                    continue
                if seq.lora is not None and seq.lora not in adapters and len(adapters) >= (self.max_loras or 0):
                    continue  # its adapter would not fit in the device slots beside the running ones
                imported = bool(seq.block_table)
                if imported:
                    # Its prompt's KV was imported: the prefix lookup is done, only the rest needs room.
                    num_tokens = min(seq.num_uncomputed_tokens, budget)
                    admitted = self.block_manager.allocate_slots(seq, num_tokens)
                else:
                    hits = self.block_manager.find_cached_prefix(seq)
                    if self.block_manager.waits_for_a_block_being_computed(seq, hits):
                        continue  # finds it cached in a step or a few (block_manager's docstring); others may go
                    num_tokens = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
                    admitted = self.block_manager.allocate_slots(seq, num_tokens, prefix_blocks=hits)
                if not admitted:
                    blocked = True
                    continue
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.lora is not None:
                    adapters.add(seq.lora)
                scheduled[seq] = num_tokens
                budget -= num_tokens
                out.admitted.append(seq)
                if not imported:  # its uncached blocks are computed here, from this step on
                    self.block_manager.announce_computing(seq)

        for seq in self.running:  # drafts the budget or the pool left no room for are dropped
            if seq.spec_token_ids:
                del seq.spec_token_ids[max(scheduled.get(seq, 0) - seq.num_uncomputed_tokens, 0):]
        out.seqs = list(scheduled)
        out.num_new_tokens = list(scheduled.values())
        return out

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Retire a sequence that stopped; its blocks go back to the pool at once (unless `free_blocks` is False:
        the caller frees them later)."""
        self._remove(seq)
        if free_blocks:
            self.block_manager.free(seq)  # which withdraws what it announced too
        else:
            self.block_manager.stop_computing(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str, free_blocks: bool = True) -> Sequence | None:
        """Drop a request wherever it is; returns it, or None if it is unknown or already done."""
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, "abort", free_blocks)
                return seq
        return None

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _arrival_order(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.arrival_order
