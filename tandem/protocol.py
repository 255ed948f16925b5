"""Models shared across processes: sampling parameters and (later) the P/D wire protocol.

One definition each, imported by the router and the workers alike (ARCHITECTURE.md §3).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. Validated at the API edge; the engine trusts it."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 or 0 disables top-k")
    seed: int | None = None
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token; None = none")
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
