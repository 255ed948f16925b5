"""How many streams the decode pool can hold at an inter-token target, and how long a stream holds its place.

Per decode worker in rotation, the streams it can hold are the fewest of: its max_num_seqs; the streams whose KV
(prompt + expected output) its cache holds, beside what its running streams hold; and the largest batch whose decode
step its step cost model (tandem.step_cost) predicts within the target, at the worker's measured step tail. The pool's capacity for this router is their sum less the streams
the workers report that are not this router's (other router replicas'). docs/admission.md has the formula.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.router.pool import Worker


class DecodeCapacity:
    def __init__(self, workers: Callable[[], list[Worker]], block_size: int):
        """`workers`: the decode workers in rotation, as the router's probes last saw them."""
        self.workers = workers
        self.block_size = block_size

    def streams(self, itl_s: float, prompt_tokens: int, output_tokens: int,
                handoff_itl_s: float | None = None) -> tuple[int, bool] | None:
        """(streams like this one this router may have decoding at once, whether some worker could serve one at the
        targets even alone); None when no decode worker is in rotation (nothing to wait for: the request is
        answered no_workers).

        Every stream's gaps must stay within `itl_s`: a worker's predicted decode step for the batch, times its
        step tail (StepTail), at most that. A stream that comes from a prefill worker has one more gap,
        `handoff_itl_s` its target: between the prefill's first token and the decode worker's second, the pull of
        its KV and up to two steps (the one under way when it arrives, then its own). A worker's tail is what its
        load costs its steps: an idle worker's steps are judged without it."""
        workers = self.workers()
        if not workers:
            return None
        blocks = max(1, -(-(prompt_tokens + output_tokens) // self.block_size))
        mean_context = prompt_tokens + output_tokens / 2  # its context over its life, on average
        total = others = 0
        feasible = False
        for worker in workers:
            idle = not (worker.running or worker.in_flight)
            held = worker.max_num_seqs
            if worker.total_blocks:  # the streams it runs and those its free blocks hold, within its whole cache
                held = min(held, worker.total_blocks // blocks, worker.running + worker.free_blocks // blocks)
            cost = worker.step_cost
            if cost is not None:
                tail = 1.0 if idle else worker.step_tail
                step_budget = itl_s / tail
                if handoff_itl_s is not None:
                    step_budget = min(step_budget, (handoff_itl_s - worker.kv_pull_s) / (2 * tail))
                # The batch's mean context: the reported streams' and this one's.
                context = (worker.context_tokens + mean_context) / (worker.running + 1)
                feasible = feasible or cost.largest_batch_within(step_budget, mean_context, 1) == 1
                held = cost.largest_batch_within(step_budget, context, held)
            else:
                feasible = True
            total += held
            others += max(0, worker.running - worker.in_flight_at_report)
        return max(0, total - others), feasible

    def hold_s(self, prompt_tokens: int, output_tokens: int, streams: int) -> float | None:
        """The seconds a stream like this one is predicted to hold its place with `streams` decoding beside it: its
        output at the slowest worker's step time for that batch; None without a step cost model."""
        steps = [w.step_cost.decode_step_s(streams, streams * (prompt_tokens + output_tokens / 2))
                 for w in self.workers() if w.step_cost is not None]
        return max(steps) * output_tokens if steps else None
