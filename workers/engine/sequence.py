"""One request as the engine sees it: its tokens, where they sit in the KV cache and its timings.

A sequence never distinguishes "prefill" from "decode" by a flag: it has `num_tokens` known
tokens of which the first `num_computed_tokens` have their K/V in the cache. A step computes
some of the rest; once all are computed the next token is sampled and appended. A decode is
then just "one token left to compute", and recompute after preemption is a longer prefill
over prompt + output, which keeps scheduler and runner free of special cases (as in vLLM v1).
"""

from __future__ import annotations

import enum
import itertools
import time

import torch

from tandem.protocol import SamplingParams

# Breaks ties between equal arrival times so "latest arrived" is always well defined.
_arrival_counter = itertools.count()
# Seeds for successive positions are spread over the 64-bit range by splitmix64's increment.
_GOLDEN_GAMMA, _MASK64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "token_ids", "params", "status",
        "finish_reason", "num_computed_tokens", "block_table", "block_hashes", "num_cached_blocks",
        "num_cached_tokens", "arrival_time", "arrival_order", "first_scheduled_time",
        "first_token_time", "last_token_time", "generator", "num_preemptions", "prefill_only", "kv_source",
        "output_tokens_in_prompt", "prompt_logprobs", "spec_token_ids", "spec_generators", "spec_history",
        "lora", "hash_seed",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, device: str | torch.device = "cpu"):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output in one list: the runner and the hasher slice it without concatenating.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Chained content hashes of the full blocks of token_ids known so far; they survive
        # preemption because the tokens do.
        self.block_hashes: list[int] = []
        # How many leading entries of block_table have been offered to the prefix cache.
        self.num_cached_blocks = 0
        # Prompt tokens found in the prefix cache at (the latest) admission.
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrival_counter)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        # P/D: a prefill-only request stops after its first token and leaves its blocks leased;
        # a request with a kv_source pulls its prompt's KV from a prefill worker before running.
        self.prefill_only = False
        self.kv_source = None
        # A resumed request: how many of its prompt tokens are output made before (by the worker that failed).
        self.output_tokens_in_prompt = 0
        # params.prompt_logprobs: one entry per prompt token as its prefill computes them (none for the first).
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]
        # A private generator makes a seeded request reproducible whatever shares its batch (see
        # next_token_generator for where it is seeded).
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
        # Speculative decoding: tokens drafted for this step (after token_ids, not part of them until accepted),
        # and the generators their positions sample with (a seeded request's, one per draft).
        self.spec_token_ids: list[int] = []
        self.spec_generators: list[torch.Generator] = []
        self.spec_history = None  # its drafts' acceptance (spec_decode.adaptive.AcceptanceHistory), once drafted for
        # Multi-LoRA: the adapter's name (None: the base model), and the seed of its block hashes (None: the
        # block manager's own).
        self.lora: str | None = None
        self.hash_seed: int | None = None

    def next_token_generator(self) -> torch.Generator | None:
        """A seeded request's generator, seeded for the output position it samples next from (seed, position).
        Each token then depends on its position only, not on the draws before it on this worker: a decode
        worker continuing after a prefill worker's first token, or one resuming a request, samples what one
        worker alone would have (one generator seeded once would start over at the first token's draw)."""
        if self.generator is not None:
            self._seed(self.generator, 0)
        return self.generator

    def token_generators(self, count: int) -> list[torch.Generator | None]:
        """Generators for the next `count` output positions, each seeded as next_token_generator would seed it
        once the tokens before were appended: a verified draft samples what a plain decode step would have."""
        if self.generator is None:
            return [None] * count
        while len(self.spec_generators) < count - 1:
            self.spec_generators.append(torch.Generator(device=self.generator.device))
        generators = [self.generator, *self.spec_generators[:count - 1]]
        for offset, generator in enumerate(generators):
            self._seed(generator, offset)
        return generators

    def _seed(self, generator: torch.Generator, offset: int) -> None:
        position = self.output_tokens_in_prompt + self.num_output_tokens + offset
        generator.manual_seed((self.params.seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Forget the KV state (the caller has freed the blocks); the tokens stay."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_cached_blocks = 0
        self.spec_token_ids = []
        self.num_preemptions += 1  # (num_cached_tokens stays its first admission's: BlockManager.allocate_slots)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
