"""How many streams the decode pool can hold at an inter-token target, and how long a stream holds its place.

Per decode worker in rotation, the streams it can hold are the fewest of: its max_num_seqs; the streams whose KV
(prompt + expected output) its cache holds; and the largest batch whose decode step its step cost model
(tandem.step_cost) predicts within the target, at the worker's measured step tail. The pool's capacity for this router is their sum less the streams
the workers report that are not this router's (other router replicas'). docs/admission.md has the formula.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.router.pool import Worker

DEFAULT_MAX_NUM_SEQS = 64  # the engine's default, for a worker that reports none


class DecodeCapacity:
    def __init__(self, workers: Callable[[], list[Worker]], block_size: int):
        """`workers`: the decode workers in rotation, as the router's probes last saw them."""
        self.workers = workers
        self.block_size = block_size

    def streams(self, itl_s: float, prompt_tokens: int, output_tokens: int,
                handoff_itl_s: float | None = None) -> int | None:
        """Streams like this one this router may have decoding at once; None when no decode worker is in rotation
        (nothing to wait for: the request is answered no_workers).

        Every stream's gaps must stay within `itl_s`: a worker's predicted decode step for the batch, times its
        step tail (StepTail), at most that. A stream that comes from a prefill worker has one more gap,
        `handoff_itl_s` its target: between the prefill's first token and the decode worker's second, the pull of
        its KV and up to two steps (the one under way when it arrives, then its own). An idle worker whose cache holds
        the stream takes it however slow its steps: a stream alone is the best it can do."""
        workers = self.workers()
        if not workers:
            return None
        blocks = max(1, -(-(prompt_tokens + output_tokens) // self.block_size))
        mean_context = prompt_tokens + output_tokens / 2  # its context over its life, on average
        total = others = 0
        for worker in workers:
            held = worker.max_num_seqs or DEFAULT_MAX_NUM_SEQS
            if worker.total_blocks:
                held = min(held, worker.total_blocks // blocks)
            cost = worker.step_cost
            if cost is not None and held:
                step_budget = itl_s / worker.step_tail
                if handoff_itl_s is not None:
                    step_budget = min(step_budget, (handoff_itl_s - worker.kv_pull_s) / (2 * worker.step_tail))
                # The batch's mean context: the reported streams' and this one's.
                context = (worker.context_tokens + mean_context) / (worker.running + 1)
                within = cost.largest_batch_within(step_budget, context, held)
                # An idle worker takes a stream however slow its steps (a stream alone is the best it can do); a busy
                # one only what fits the targets.
                held = within if worker.running or worker.in_flight else max(1, within)
            total += held
            others += max(0, worker.running - worker.in_flight_at_report)
        return max(0, total - others)

    def hold_s(self, prompt_tokens: int, output_tokens: int, streams: int) -> float | None:
        """The seconds a stream like this one is predicted to hold its place with `streams` decoding beside it: its
        output at the slowest worker's step time for that batch; None without a step cost model."""
        steps = [w.step_cost.decode_step_s(streams, streams * (prompt_tokens + output_tokens / 2))
                 for w in self.workers() if w.step_cost is not None]
        return max(steps) * output_tokens if steps else None
