"""Speculative decoding: proposers draft tokens, the engine verifies them in one forward pass (docs/speculative-decoding.md)."""

from tandem.workers.engine.spec_decode.proposer import Proposer, make_proposer

__all__ = ["Proposer", "make_proposer"]
