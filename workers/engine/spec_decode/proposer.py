"""The interface every proposer implements, and the one that builds a proposer from its config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.config import SpeculativeConfig


class Proposer(Protocol):
    """Drafts the next tokens of sequences, to be verified by the target model in one step."""

    def propose(self, token_ids: Sequence[list[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        """For each sequence (its prompt and output so far), at most max_tokens[i] drafted tokens (maybe none)."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer `config.method` names."""
    if config.method == "ngram":
        from tandem.workers.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.method!r}")
