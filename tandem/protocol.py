"""Models shared across processes: sampling parameters and (later) the P/D wire protocol.

One definition each, imported by the router and the workers alike (ARCHITECTURE.md §3).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds that keep a penalized logit finite in float32 (a logit of 30 divided by 1e-40 is inf, and 0 * inf NaN).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the seed range: wider seeds overflow torch's generators
# A token id as a client may name one: ids past the vocabulary never match, but ints past 64 bits would not
# even serialize on the way to the workers.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class StructuredOutput(BaseModel):
    """A constraint on the whole output (tandem.openai.structured_output): the tokens a step may pick are those that keep
    the text within it."""

    model_config = ConfigDict(frozen=True)  # hashable: compiled grammars are cached by it

    kind: Literal["json", "regex", "choice", "grammar"]
    # json: a JSON schema (as JSON text); regex: a regular expression the whole output matches; choice: a JSON list
    # of the strings the output may be; grammar: a Lark or GBNF grammar.
    value: str


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. Validated at the API edge; the engine trusts it."""

    model_config = ConfigDict(allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p x the likeliest one; "
                                                           "0 disables it")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token; None = none")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = Field(True, description="leave special tokens (<|im_end|>, ...) out of the text")
    # OpenAI's penalties on what the request has generated so far, and vLLM's repetition penalty on every token
    # seen (prompt and output); see workers.engine.sampler.apply_penalties.
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids are held back until this many tokens "
                                                 "are generated (vLLM's); stop strings still apply")
    logit_bias: list[tuple[TokenId, float]] = Field(default_factory=list, description="(token id, bias) pairs "
                                                    "added to the logits before penalties and sampling")
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="logprobs of the prompt's tokens (each "
                                        "with this many top alternatives), computed in full: no prefix-cache hit")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the tokens so far (workers.engine.sampler.History)."""
        return self.min_tokens > 0 or self.penalized


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
    tp_size: int = 1  # the ranks the KV heads are split over (each holds its own blocks' share)

    def mismatches(self, local: LayoutFingerprint) -> list[str]:
        """Human-readable differences, e.g. ['block_size: handle 16, this worker 32']. KV split over several
        tensor-parallel ranks does not move between workers yet: such a handle, or such a worker, is a mismatch."""
        found = [f"{name}: handle {getattr(self, name)!r}, this worker {getattr(local, name)!r}"
                 for name in type(self).model_fields if getattr(self, name) != getattr(local, name)]
        if not found and local.tp_size > 1:
            found.append(f"tp_size: {local.tp_size} on both, and KV split over tensor-parallel ranks is not "
                         "pulled between workers yet")
        return found


class KVHandle(BaseModel):
    """Names the KV blocks a prefill worker holds for one prompt, under a lease."""

    source_url: str = Field(description="the prefill worker's base URL (for /internal/kv/agent and release)")
    agent_name: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    layout: LayoutFingerprint
    expires_at: float = Field(description="unix time after which the blocks may be gone")
    lora_name: str | None = Field(None, description="the LoRA adapter the KV was computed with (None: the base model)")


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)


CLIENT_REQUEST_ID = Field(None, max_length=128, description="the client's x-request-id (or the router's), for the "
                                                             "worker's log lines about the request")


class PrefillRequest(BaseModel):
    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    client_request_id: str | None = CLIENT_REQUEST_ID
    lora_name: str | None = Field(None, description="the LoRA adapter to serve it with (None: the base model)")


class PrefillResponse(BaseModel):
    request_id: str
    first_token_id: int
    first_token_text: str = ""
    first_token_logprob: TokenLogprob | None = None
    finish_reason: str | None = Field(None, description="set when the request already ended at its first token")
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended it, if one did")
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
    client_request_id: str | None = CLIENT_REQUEST_ID
    lora_name: str | None = Field(None, description="the LoRA adapter to serve it with (None: the base model)")
    output_tokens_in_prompt: int = Field(
        0, ge=0, description="resuming a request whose worker failed: how many of the last prompt_token_ids are "
                             "output made before (first_token_id is one more). The worker replays them through its "
                             "detokenizer, so the text the failed worker held back for stop strings still comes")
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
    stop_reason: int | str | None = None  # the stop string or stop token id that ended the output, if one did
    num_cached_tokens: int = 0
    kv_source: str | None = Field(None, description="'pulled', 'local' or a fallback reason; on the first chunk")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(None, description="on the first chunk, when asked "
                                                              "for: one per prompt token, None for the first")


def join_decode_events(events: list[dict]) -> dict:
    """Consecutive decode events of one request (DecodeChunk as JSON) as one: tokens, text and logprobs in
    order, the last event's finish and cached-token count, the first kv_source and prompt_logprobs. A worker joins what it holds
    back (coalesce_after_first); a router joins what arrived together, to relay it once."""
    if len(events) == 1:
        return events[0]
    last = events[-1]
    joined = {"token_ids": [t for e in events for t in e["token_ids"]],
              "text": "".join(e.get("text", "") for e in events)}
    logprobs = [entry for e in events for entry in e.get("logprobs") or ()]
    if logprobs:
        joined["logprobs"] = logprobs
    for key in ("finish_reason", "stop_reason", "num_cached_tokens"):
        if key in last:
            joined[key] = last[key]
    for key in ("kv_source", "prompt_logprobs"):  # the first event's
        value = next((e[key] for e in events if e.get(key)), None)
        if value is not None:
            joined[key] = value
    return joined


class ReleaseRequest(BaseModel):
    lease_id: str
    # Sent by the decode worker whose read of the blocks is over (and only then): see LeaseTable.release.
    after_read: bool = False


class AbortRequest(BaseModel):
    request_id: str
