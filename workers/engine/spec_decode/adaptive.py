"""How many drafts each sequence verifies: its acceptance history, weighed against the step cost model.

Each sequence keeps a decaying estimate of the chance a ≈ P(its next draft is accepted | the ones before it were),
so its j-th draft is worth a^j expected tokens. A step's plan adds drafts in order of expected tokens per second of
step time they add (the decode model of tandem.step_cost: each row a sequence's step computes costs
decode_sequence_s, plus decode_pair_s per key it attends to) while each one's ratio beats the step's own tokens
per second so far; so a draft is verified only where it raises the step's throughput. A large batch already makes
many tokens per second, and its drafts stop paying: the plan then verifies none (docs/speculative-decoding.md).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tandem.step_cost import StepCost, StepCostFit
from tandem.workers.engine.sequence import Sequence
from tandem.workers.engine.spec_decode.proposer import Proposer
from tandem.workers.engine.spec_decode.stats import SpecDecodeStats
from tandem.workers.engine.spec_decode.verify import draft_limit

DECAY = 0.8  # the weight a verification's outcome keeps for every later one of the same sequence
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0  # a new sequence's estimate: 1/2
FIRST_PAUSE, LONGEST_PAUSE = 4, 16  # steps a sequence stops drafting for: doubled after each failed retry
NO_MODEL_FLOOR = 0.25  # before the engine has a step cost model: drafts worth at least this many tokens


@dataclass(slots=True)
class AcceptanceHistory:
    """One sequence's acceptance estimate, and its pause from drafting."""

    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    paused: int = 0  # steps left without drafting
    next_pause: int = FIRST_PAUSE
    probing: bool = False  # a pause ended: its next draft is one token, planned at the prior's rate
    shadow: int | None = None  # a first draft the plan dropped this step, checked against the token sampled instead

    @property
    def rate(self) -> float:
        """The chance a draft is accepted where the ones before it were."""
        return self.accepted / self.tried

    @property
    def plan_rate(self) -> float:
        """The rate its drafts are planned with: a retry after a pause gets the benefit of the doubt."""
        return PRIOR_ACCEPTED / PRIOR_TRIED if self.probing else self.rate

    def record(self, drafted: int, accepted: int) -> None:
        """A verification's outcome: `accepted` drafts of `drafted` (each a trial until the first rejection)."""
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)
        self.probing = False
        if accepted:
            self.next_pause = FIRST_PAUSE

    def check_shadow(self, sampled: int) -> None:
        """Learn from a dropped first draft for free: it would have been accepted iff it equals what was sampled."""
        if self.shadow is not None:
            self.record(1, int(self.shadow == sampled))
            self.shadow = None

    def limit(self, k: int) -> int:
        """The most it drafts this step: none while paused (counting the step off), one on a retry, else k."""
        if self.paused:
            self.paused -= 1
            self.probing = not self.paused
            return 0
        return 1 if self.probing else k

    def pause(self) -> None:
        """Stop drafting for a while: its drafts are not worth verifying even alone."""
        self.paused = self.next_pause
        self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
        self.probing = False


def plan_drafts(cost: StepCost | None, contexts: list[int], rates: list[float], drafts: list[int]) -> list[int]:
    """How many of its `drafts` each of a step's decodes verifies (`contexts`: their tokens; `rates`: their a)."""
    if cost is None:
        return [sum(rate ** j >= NO_MODEL_FLOOR for j in range(1, n + 1)) for rate, n in zip(rates, drafts, strict=True)]
    tokens = float(len(contexts))
    seconds = cost.decode_step_s(len(contexts), sum(contexts))
    candidates = []  # (expected tokens, seconds added, decode), each decode's in draft order
    for i, (context, rate, n) in enumerate(zip(contexts, rates, drafts, strict=True)):
        for j in range(1, n + 1):
            candidates.append((rate ** j, cost.decode_sequence_s + cost.decode_pair_s * (context + j), i))
    # Best ratio first; within a decode the ratio falls with j, and the sort is stable, so each keeps a prefix.
    candidates.sort(key=lambda c: c[0] / c[1] if c[1] > 0 else float("inf"), reverse=True)
    planned = [0] * len(contexts)
    for value, added, i in candidates:
        if value * seconds <= added * tokens:  # no better than the step's tokens per second: nor are the rest
            break
        planned[i] += 1
        tokens += value
        seconds += added
    return planned


def worth_alone(cost: StepCost | None, context: int, rate: float) -> bool:
    """Whether a first draft at `rate` would be verified in a step of its sequence alone."""
    return plan_drafts(cost, [context], [rate], [1])[0] == 1


def draft(decodes: Seq[Sequence], proposer: Proposer, max_drafts: int, max_model_len: int, fit: StepCostFit,
          stats: SpecDecodeStats) -> None:
    """Set each of a step's `decodes`' spec_token_ids: as many drafts as its acceptance history and the step cost
    model (`fit`'s) make worth verifying, at most `max_drafts`; a sequence paused from drafting counts a step off."""
    seqs, limits = [], []
    for seq in decodes:
        limit = draft_limit(seq, max_drafts, max_model_len)
        if limit:
            if seq.spec_history is None:
                seq.spec_history = AcceptanceHistory()
            limit = seq.spec_history.limit(limit)
            if limit:
                seqs.append(seq)
                limits.append(limit)
    if not seqs:
        stats.planned(len(decodes), 0, False)
        return
    for seq, drafts in zip(seqs, proposer.propose([s.token_ids for s in seqs], limits), strict=True):
        seq.spec_token_ids = drafts
    cost = fit.cost()
    contexts = [seq.num_tokens for seq in decodes]
    rates = [seq.spec_history.plan_rate if seq.spec_token_ids else 0.0 for seq in decodes]
    planned = plan_drafts(cost, contexts, rates, [len(seq.spec_token_ids) for seq in decodes])
    drafted = False
    for seq, k, context in zip(decodes, planned, contexts, strict=True):
        history = seq.spec_history
        if history is not None:
            history.shadow = seq.spec_token_ids[0] if seq.spec_token_ids and not k else None
        if seq.spec_token_ids:
            drafted = True
            if not k and not worth_alone(cost, context, history.rate):
                history.pause()  # its drafts keep failing: it retries later
            del seq.spec_token_ids[k:]
    stats.planned(len(decodes), sum(planned), drafted and not any(planned))
