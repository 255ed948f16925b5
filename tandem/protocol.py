"""Models shared across processes: sampling parameters and (later) the P/D wire protocol.

One definition each, imported by the router and the workers alike (ARCHITECTURE.md §3).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the seed range: wider seeds overflow torch's generators


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. Validated at the API edge; the engine trusts it."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 or 0 disables top-k")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token; None = none")
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# -- P/D wire protocol (ARCHITECTURE.md §3): JSON over HTTP on each worker's internal port ----------


class LayoutFingerprint(BaseModel):
    """Everything that must match for one worker's KV blocks to be valid in another's cache."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0

    def mismatches(self, local: LayoutFingerprint) -> list[str]:
        """Human-readable differences, e.g. ['block_size: handle 16, this worker 32']."""
        return [f"{name}: handle {getattr(self, name)!r}, this worker {getattr(local, name)!r}"
                for name in type(self).model_fields if getattr(self, name) != getattr(local, name)]


class KVHandle(BaseModel):
    """Names the KV blocks a prefill worker holds for one prompt, under a lease."""

    source_url: str = Field(description="the prefill worker's base URL (for /internal/kv/agent and release)")
    agent_name: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    layout: LayoutFingerprint
    expires_at: float = Field(description="unix time after which the blocks may be gone")


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)


class PrefillRequest(BaseModel):
    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams


class PrefillResponse(BaseModel):
    request_id: str
    first_token_id: int
    first_token_text: str = ""
    first_token_logprob: TokenLogprob | None = None
    finish_reason: str | None = Field(None, description="set when the request already ended at its first token")
    kv_handle: KVHandle | None = Field(None, description="absent when finished (nothing left to decode)")
    num_cached_tokens: int = 0


class DecodeRequest(BaseModel):
    """Continue a request on a decode worker. Without a kv_handle the worker computes the prompt
    itself (colocated path, or resuming a migrated request from prompt + tokens so far)."""

    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    first_token_id: int | None = None
    kv_handle: KVHandle | None = None
    sampling: SamplingParams
    coalesce_after_first: bool = Field(
        False, description="send the first event at once and everything after it as one event at the end: the "
                           "router asks this for a client that did not ask to stream, whose first token it must "
                           "time (TTFT, admission) but whose other tokens it would only collect")


class DecodeChunk(BaseModel):
    """One SSE event of /internal/decode."""

    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    kv_source: str | None = Field(None, description="'pulled', 'local' or a fallback reason; on the first chunk")

    @staticmethod
    def joined(chunks: list[DecodeChunk]) -> DecodeChunk:
        """Consecutive chunks of one request as one (coalesce_after_first): tokens, text and logprobs in order,
        the last chunk's finish."""
        logprobs = [e for c in chunks for e in c.logprobs or ()]
        return DecodeChunk(token_ids=[t for c in chunks for t in c.token_ids], text="".join(c.text for c in chunks),
                           logprobs=logprobs or None, finish_reason=chunks[-1].finish_reason,
                           num_cached_tokens=chunks[-1].num_cached_tokens,
                           kv_source=next((c.kv_source for c in chunks if c.kv_source), None))


class ReleaseRequest(BaseModel):
    lease_id: str


class AbortRequest(BaseModel):
    request_id: str
