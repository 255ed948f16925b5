"""Verification of drafted tokens against the target model's own samples.

The target samples every position of a speculating sequence as a plain decode step would (same logits
processing, same per-position seed); a draft is kept while it equals that sample, and the first sample that
differs (or the one after the last draft) is emitted in its place. For a draft that is one token, not a
distribution (n-gram lookup), this is the standard rejection sampling: draft x is accepted with probability
p(x), and on rejection the token comes from p with x removed, renormalised: the output is distributed exactly
as the target's, and a seeded request emits the very tokens it would without speculation.
"""

from __future__ import annotations

from tandem.workers.engine.sequence import Sequence


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts the target's samples at their positions confirm."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many tokens `seq` may have drafted this step: at most k, none past its max_tokens or the context."""
    if seq.prefill_only or seq.params.structured is not None:  # structured outputs are not speculated
        return 0
    room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
    return max(0, min(k, room))
