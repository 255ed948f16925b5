"""The engine's step loop: schedule, run the model once, sample, detokenize, stop, report.

One `step()` is one forward pass over a flattened batch of decodes and prefill chunks. The
engine is single-threaded and synchronous; a server drives it from one thread and feeds it
with add_request/abort_request between steps. Times are time.monotonic() seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.hashing import model_seed
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.detokenizer import IncrementalDetokenizer
from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.engine.sampler import Sampler, TokenLogprobs
from tandem.workers.engine.scheduler import Scheduler
from tandem.workers.engine.sequence import Sequence
from tandem.workers.models.loader import load_model

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, for streaming)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class GenerationResult:
    """A whole request's output, as `LLMEngine.generate` collects it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class _Request:
    __slots__ = ("seq", "detokenizer", "stop_token_ids")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None, stop_token_ids: frozenset[int]):
        self.seq = seq
        self.detokenizer = detokenizer
        self.stop_token_ids = stop_token_ids


class LLMEngine:
    def __init__(self, loaded: Any, config: EngineConfig, metrics: EngineMetrics | None = None):
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        model_max_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length "
                             f"({model_max_len})")
        self.max_model_len = config.max_model_len or model_max_len
        self.model_name = config.served_model_name or loaded.config.name
        self.runner = ModelRunner(loaded, config)
        # Keyed by the served name, as the router keys its routing hashes.
        self.hash_seed = model_seed(self.model_name)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, self.hash_seed,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed, device=self.runner.device)
        self.metrics = metrics
        eos = set(loaded.config.eos_token_ids or [])
        if self.tokenizer is not None:
            eos.update(getattr(self.tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, _Request] = {}
        self._abort_outputs: list[RequestOutput] = []
        # Cumulative counters (also mirrored into `metrics`).
        self.num_prompt_tokens = 0
        self.num_computed_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = dict.fromkeys(FINISH_REASONS, 0)
        self._reported_queried = 0
        self._reported_hits = 0
        self._reported_preemptions = 0
        if metrics is not None:
            metrics.kv_blocks_total.set(self.block_manager.num_total_blocks)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: EngineMetrics | None = None) -> LLMEngine:
        """Load `config.model` (resolving device and attention backend "auto") and build the engine."""
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if torch.device(device).type == "cuda" else "torch"
        loaded = load_model(config.model, dtype=config.dtype, device=device, backend=backend,
                            served_name=config.served_model_name)
        return cls(loaded, config, metrics)

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"request {request_id!r}: prompt token ids must lie in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        if self.block_manager.blocks_for(total) > self.block_manager.num_total_blocks:
            raise ValueError(f"request {request_id!r}: {total} tokens need more KV blocks than the cache holds "
                             f"({self.block_manager.num_total_blocks} blocks of {self.config.block_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model was loaded without one")

        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time, device=self.runner.device)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop,
                                                 params.include_stop_str_in_output)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        self._requests[request_id] = _Request(seq, detokenizer, frozenset(stop_ids))
        self.scheduler.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
            self.metrics.waiting.set(len(self.scheduler.waiting))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next step() reports it finished with "abort"."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        seq = request.seq
        self.scheduler.abort(request_id)
        self._count_finished("abort")
        self._abort_outputs.append(RequestOutput(request_id, [], "", None, True, "abort", seq.num_prompt_tokens,
                                                 seq.num_cached_tokens))
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._abort_outputs)

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        outputs, self._abort_outputs = self._abort_outputs, []
        scheduled = self.scheduler.schedule()
        now = time.monotonic()
        for seq in scheduled.admitted:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if self.metrics is not None:
                    self.metrics.queue_time.observe(now - seq.arrival_time)

        if scheduled:
            logits, sample_rows = self.runner.execute(scheduled.seqs, scheduled.num_new_tokens)
            computed_prompt = 0
            for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True):
                start = seq.num_computed_tokens
                if start < seq.num_prompt_tokens:
                    computed_prompt += min(start + num_new, seq.num_prompt_tokens) - start
                seq.num_computed_tokens = start + num_new
                # Only now is their K/V in the cache, so only now may other requests find them.
                self.block_manager.cache_computed_blocks(seq)
            if computed_prompt:
                self.num_computed_prompt_tokens += computed_prompt
                if self.metrics is not None:
                    self.metrics.computed_prompt_tokens.inc(computed_prompt)
            if sample_rows:
                seqs = [scheduled.seqs[row] for row in sample_rows]
                sampled = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
                now = time.monotonic()
                self.num_generation_tokens += len(seqs)
                if self.metrics is not None:
                    self.metrics.generation_tokens.inc(len(seqs))
                for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                    outputs.append(self._append_token(seq, token_id, logprobs, now))

        self._update_gauges()
        return outputs

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[GenerationResult]:
        """Run prompts to completion together (offline use, benchmarks, tests)."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        results: dict[str, GenerationResult] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            request_id = f"generate-{id(results)}-{i}"
            self.add_request(request_id, prompt, p)
            results[request_id] = GenerationResult(request_id)
        pending = set(results)
        while pending:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                result.logprobs.extend(out.new_logprobs or [])
                result.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    result.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return list(results.values())

    # ----------------------------------------------------------------- stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_kv_blocks_used(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def num_kv_blocks_total(self) -> int:
        return self.block_manager.num_total_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_prefix_queried_tokens(self) -> int:
        return self.block_manager.num_queried_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.block_manager.num_hit_tokens

    # ----------------------------------------------------------------- internals

    def _append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None, now: float) -> RequestOutput:
        request = self._requests[seq.request_id]
        seq.append_token(token_id)
        metrics = self.metrics
        if seq.first_token_time is None:
            seq.first_token_time = now
            if metrics is not None:
                metrics.ttft.observe(now - seq.arrival_time)
        elif metrics is not None:
            metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now

        detokenizer = request.detokenizer
        text = ""
        reason = None
        if token_id in request.stop_token_ids:
            reason = "stop"  # the stop token's id is reported, its text is not
        else:
            if detokenizer is not None:
                text = detokenizer.add_token(token_id)
                if detokenizer.stopped:
                    reason = "stop"
            if reason is None and (seq.num_output_tokens >= seq.params.max_tokens
                                   or seq.num_tokens >= self.max_model_len):
                reason = "length"
        if reason is not None:
            if detokenizer is not None:
                text += detokenizer.flush()
            self._finish(seq, reason, now)
        return RequestOutput(seq.request_id, [token_id], text, None if logprobs is None else [logprobs],
                             reason is not None, reason, seq.num_prompt_tokens, seq.num_cached_tokens)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        del self._requests[seq.request_id]
        self._count_finished(reason)
        if self.metrics is not None:
            self.metrics.e2e.observe(now - seq.arrival_time)

    def _count_finished(self, reason: str) -> None:
        self.num_finished[reason] += 1
        if self.metrics is not None:
            self.metrics.finished(reason)

    def _update_gauges(self) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        bm = self.block_manager
        metrics.running.set(len(self.scheduler.running))
        metrics.waiting.set(len(self.scheduler.waiting))
        metrics.kv_blocks_used.set(bm.num_used_blocks)
        if bm.num_queried_tokens != self._reported_queried:
            metrics.prefix_queried.inc(bm.num_queried_tokens - self._reported_queried)
            self._reported_queried = bm.num_queried_tokens
        if bm.num_hit_tokens != self._reported_hits:
            metrics.prefix_hit.inc(bm.num_hit_tokens - self._reported_hits)
            self._reported_hits = bm.num_hit_tokens
        if self.scheduler.num_preemptions != self._reported_preemptions:
            metrics.preemptions.inc(self.scheduler.num_preemptions - self._reported_preemptions)
            self._reported_preemptions = self.scheduler.num_preemptions
