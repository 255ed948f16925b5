"""Predicted prefill times from the step cost models workers report (tandem.step_cost), as admission uses them."""

from __future__ import annotations

from tandem.router.pool import Worker
from tandem.step_cost import attention_pairs


def prefill_s(workers: list[Worker], uncached: int, prompt_tokens: int, colocated: bool) -> float | None:
    """Seconds to compute `uncached` tokens of a `prompt_tokens` prompt on the slowest of `workers` (a prefill pool,
    or a decode pool for a colocated prompt, whose steps it shares with the decodes running there); None when none
    of them reports a step cost model."""
    times = []
    for worker in workers:
        if worker.step_cost is None:
            continue
        decodes = min(worker.running, worker.max_num_seqs) if colocated else 0
        times.append(worker.step_cost.prefill_s(uncached, prompt_tokens - uncached, worker.max_num_batched_tokens,
                                                decodes, worker.context_tokens if colocated else 0))
    return max(times) if times else None


def colocated_stall_s(workers: list[Worker], uncached: int, prompt_tokens: int) -> float | None:
    """The longest decode step a colocated prompt's first chunk makes on one of the decode `workers`: the wait it
    puts between two tokens of every stream decoding there; None when none reports a step cost model."""
    stalls = []
    for worker in workers:
        cost = worker.step_cost
        if cost is None:
            continue
        decodes = min(worker.running, worker.max_num_seqs)
        chunk = max(1, min(uncached, worker.max_num_batched_tokens - decodes))
        step = cost.step_s(decodes + chunk, decodes + 1,
                           worker.context_tokens + attention_pairs(prompt_tokens - uncached, chunk))
        stalls.append(step * (worker.step_tail if decodes else 1.0))
    return max(stalls) if stalls else None
