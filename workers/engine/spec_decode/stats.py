"""Speculative decoding's counters: drafts, drafted and accepted tokens (by position), as vLLM counts them; steps
that skipped speculation and the mean drafts per decode of the latest step."""

from __future__ import annotations


class SpecDecodeStats:
    """Cumulative counts, and what of them is not yet reported to the metrics."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        self.num_skipped_steps = 0  # steps whose decodes had drafts, none of them worth verifying
        self.mean_k = 0.0  # drafts verified per decode, in the latest step with decodes
        self._reported = (0, 0, 0, [0] * num_speculative_tokens)
        self._reported_skipped = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per draft verified: the accepted ones and the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def planned(self, decodes: int, verified: int, skipped: bool) -> None:
        """A step's plan: `verified` drafts over its `decodes`; `skipped` if it had drafts and verifies none."""
        self.mean_k = verified / decodes if decodes else 0.0
        self.num_skipped_steps += skipped

    def report(self, metrics) -> None:
        """Add what changed since the last report to `metrics` (tandem.metrics.EngineMetrics)."""
        metrics.spec_decode_mean_k.set(self.mean_k)
        if self.num_skipped_steps != self._reported_skipped:
            metrics.spec_decode_num_skipped_steps.inc(self.num_skipped_steps - self._reported_skipped)
            self._reported_skipped = self.num_skipped_steps
        drafts, tokens, accepted, per_position = self._reported
        if self.num_drafts == drafts:
            return
        metrics.spec_decode_num_drafts.inc(self.num_drafts - drafts)
        metrics.spec_decode_num_draft_tokens.inc(self.num_draft_tokens - tokens)
        metrics.spec_decode_num_accepted_tokens.inc(self.num_accepted_tokens - accepted)
        for position, (now, before) in enumerate(zip(self.accepted_per_position, per_position, strict=True)):
            if now != before:
                metrics.spec_decode_accepted_at(position).inc(now - before)
        self._reported = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                          list(self.accepted_per_position))
