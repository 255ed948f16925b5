"""The engine's step loop: schedule, run the model once, sample, detokenize, stop, report.

One `step()` is one forward pass over a flattened batch of decodes and prefill chunks. The
engine is single-threaded and synchronous; a server drives it from one thread and feeds it
with add_request/abort_request between steps. Times are time.monotonic() seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.hashing import adapter_seed, model_seed
from tandem.metrics import EngineMetrics
from tandem.protocol import LayoutFingerprint, SamplingParams
from tandem.step_cost import StepCostFit, StepTail, attention_pairs
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.detokenizer import IncrementalDetokenizer
from tandem.workers.engine.grammar import GrammarMatchers
from tandem.workers.engine.kv_leases import KVLease, LeaseTable
from tandem.workers.engine.model_runner import ModelRunner, kv_cache_blocks
from tandem.workers.engine.sampler import History, Sampler, TokenLogprobs
from tandem.workers.engine.scheduler import Scheduler
from tandem.workers.engine.sequence import Sequence
from tandem.workers.engine.spec_decode import make_proposer
from tandem.workers.engine.spec_decode.adaptive import draft
from tandem.workers.engine.spec_decode.stats import SpecDecodeStats
from tandem.workers.engine.spec_decode.verify import num_accepted
from tandem.workers.kv_transfer import KVTransfer, KVTransferError
from tandem.workers.layers.ops import resolve_backend
from tandem.workers.lora.manager import LoRAManager, parse_lora_modules
from tandem.workers.models.loader import LoadedModel, load_model
from tandem.workers.tensor_parallel import TPGroup, device_for

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "prefill_done")


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, for streaming)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    # "stop" | "length" | "abort" once finished; None on a prefill-only request's last output, which is finished
    # (it carries the kv_lease) but whose answer goes on on a decode worker (counted as "prefill_done").
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_lease: KVLease | None = None  # prefill-only requests: the blocks now pinned for a decode worker
    kv_status: str | None = None  # requests with a kv_source, first output: "pulled" or the fallback reason
    # params.prompt_logprobs, first output: one entry per prompt token (None for the first, which nothing predicts)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # vLLM's: the stop string or stop token id that ended the output; None when it ended otherwise (EOS included)
    stop_reason: int | str | None = None


@dataclass
class RemoteKV:
    """Where a decode request's prompt KV lives: a prefill worker's agent and its blocks."""

    agent_info: dict
    block_ids: list[int]
    expires_at: float  # unix time
    # Called by the engine once the read is over: starts releasing the lease and returns a future that says whether
    # it was still held (the prefill worker may free a lease early: a router that gave up on this request). Only
    # then are the blocks read known to be this prompt's. Not waited for on the pull thread: a prefill worker that
    # is slow to answer (its reads can go on without its CPU, over RDMA) would hold up every pull queued behind.
    # None: the lease's time alone decides.
    release: Callable[[], Future] | None = None
    lease_id: str | None = None  # the prefill worker's lease, which a TCP pull shows its server


class LeaseLost(KVTransferError):
    """The prefill worker's lease did not hold for the whole read: what was read may not be this prompt's KV."""


@dataclass
class _Pull:
    """A KV pull under way on the pull thread, into blocks `seq` already holds."""

    seq: Sequence
    source: RemoteKV
    future: Future  # (bytes moved, seconds the read took)
    num_blocks: int
    orphaned: bool = False  # the request was aborted meanwhile: its blocks are freed once the read is over
    released: Future | None = None  # RemoteKV.release's answer, asked once the read is over

    @property
    def pending(self) -> Future:
        """What the pull waits on now: the read, then the release's answer."""
        return self.released if self.released is not None else self.future


# How long a step with nothing to compute waits for a pull to end before it returns (the worker's loop then takes
# in new requests and steps again): the bound on what an idle engine adds to a new request's start.
_PULL_WAIT_S = 0.005
# How long a step waits for a pull where steps wait for pulls (kv_pull_in_background off: CPUs by default). A
# pull of a long prompt takes tens of milliseconds on one host; one from a prefill worker that died mid-read can
# take until --kv-pull-timeout-s and longer, and the running requests would stall for all of it.
_STEP_WAIT_FOR_PULL_S = 1.0


@dataclass
class GenerationResult:
    """A whole request's output, as `LLMEngine.generate` collects it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class _Request:
    __slots__ = ("seq", "detokenizer", "stop_token_ids", "kv_status", "prompt_ids", "matcher")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None, stop_token_ids: frozenset[int],
                 matcher=None):
        self.seq = seq
        self.detokenizer = detokenizer
        self.stop_token_ids = stop_token_ids
        self.matcher = matcher  # a structured output's grammar state (tandem.workers.engine.grammar)
        self.kv_status: str | None = None  # reported once, on the first output
        self.prompt_ids: torch.Tensor | None = None  # made once, for a repetition penalty (sampler.History)

    def history(self, device, drafts: list[int] | None = None) -> History:
        """What the sampler reads for this request's penalties and min_tokens. The output starts where the
        client's prompt ends: a resumed request's replayed output and a prefill worker's first token count as
        output here, as they would on one worker alone. `drafts`: drafted tokens taken as output already (the
        history a draft's position is verified with)."""
        seq = self.seq
        start = seq.num_prompt_tokens - seq.output_tokens_in_prompt
        if self.prompt_ids is None and seq.params.repetition_penalty != 1.0:
            self.prompt_ids = torch.tensor(seq.token_ids[:start], dtype=torch.int64, device=device)
        return History(seq.token_ids + drafts if drafts else seq.token_ids, start, self.stop_token_ids, self.prompt_ids)


def resolve_device(config: EngineConfig) -> tuple[str, str]:
    """(device, attention backend) with "auto" resolved: CUDA and Triton when a GPU is present, else the CPU
    and what resolve_backend picks there."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, resolve_backend(config.attention_backend, torch.device(device).type)


def load_engine_model(config: EngineConfig, tp: TPGroup | None = None) -> LoadedModel:
    """The model an engine with `config` serves, on the device and attention backend "auto" resolves to (each rank
    of a tensor-parallel worker its shard, on its own GPU)."""
    device, backend = resolve_device(config)
    if tp is not None:
        device = str(device_for(tp.rank, torch.device(device)))
    return load_model(config.model, dtype=config.dtype, device=device, backend=backend,
                      served_name=config.served_model_name, quantized_gemv=config.quantized_gemv,
                      quantization=config.quantization, tp=tp)


class LLMEngine:
    def __init__(self, loaded: Any, config: EngineConfig, metrics: EngineMetrics | None = None):
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        model_max_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length "
                             f"({model_max_len})")
        # Settled before the cache is made: a limit past it is refused before the allocation and the CUDA graphs.
        self.max_model_len = self._fit_to_cache(config.max_model_len or model_max_len, config,
                                                kv_cache_blocks(loaded, config))
        self.model_name = config.served_model_name or loaded.config.name
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        # Keyed by the served name, as the router keys its routing hashes.
        self.hash_seed = model_seed(self.model_name)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, self.hash_seed,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                    self.runner.dtype, self.runner.device)
            for name, path in parse_lora_modules(config.lora_modules).items():
                self.lora.add(name, path)
            self.runner.lora = self.lora
            self.scheduler.max_loras = config.max_loras
        self.leases = LeaseTable(self.block_manager.pool, config.kv_lease_ttl_s)
        # Set by the worker when it serves P/D (prefill workers publish it, decode workers pull with it).
        self.kv_transfer: KVTransfer | None = None
        self._pulls: dict[str, _Pull] = {}  # by request id
        background = config.kv_pull_in_background
        self._pull_in_background = background == "on" or (background == "auto" and self.runner.device.type == "cuda")
        self._pull_thread: ThreadPoolExecutor | None = None  # made at the first pull
        mc = loaded.config
        self.layout = LayoutFingerprint(model=self.model_name, dtype=str(self.runner.kv_cache.dtype).removeprefix("torch."),
                                        block_size=config.block_size, num_layers=mc.num_layers,
                                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                        tp_size=1 if self.runner.tp is None else self.runner.tp.size)
        self.sampler = Sampler(config.seed, device=self.runner.device)
        self.metrics = metrics
        eos = set(loaded.config.eos_token_ids or [])
        if self.tokenizer is not None:
            eos.update(getattr(self.tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarMatchers(self.tokenizer, loaded.config.vocab_size, self.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._abort_outputs: list[RequestOutput] = []
        speculative = config.speculative
        self.proposer = None if speculative is None else make_proposer(speculative)
        self.num_speculative_tokens = 0 if speculative is None else speculative.num_speculative_tokens
        self.spec_stats = SpecDecodeStats(self.num_speculative_tokens)
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
        # Every step's work and seconds, fitted into the model routers predict its latencies with (tandem.step_cost);
        # the start-up calibration's steps (workers/engine/calibration.py) go in as its prior.
        self.step_costs = StepCostFit()
        self.step_tail = StepTail()  # the gaps between steps that running sequences wait through, against the model
        self._last_step_end: float | None = None  # when the last step that sampled ended, while sequences run
        self.mean_pull_s = 0.0  # KV pulls' time, smoothed (what a decode worker adds to a new stream's second token)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: EngineMetrics | None = None) -> LLMEngine:
        """Load `config.model` (resolving device and attention backend "auto") and build the engine."""
        return cls(load_engine_model(config), config, metrics)

    # ----------------------------------------------------------------- requests

    @staticmethod
    def _fit_to_cache(max_model_len: int, config: EngineConfig, num_blocks: int) -> int:
        """The context limit one sequence can have whole in the KV cache. Past it a request would be accepted as
        within the context and then refused (or never scheduled) for want of blocks, the default max_tokens of a
        chat request included. A limit the user set is refused at start, as vLLM does; the model's own is lowered
        to what the cache holds, and said."""
        capacity = num_blocks * config.block_size
        if max_model_len <= capacity:
            return max_model_len
        room = (f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}); "
                "give it more with --kv-cache-memory-gb or --num-kv-blocks")
        if config.max_model_len is not None:
            raise ValueError(f"max_model_len={max_model_len} does not fit: {room}, or lower --max-model-len")
        log.warning("serving a context of %d tokens, not the model's %d: %s", capacity, max_model_len, room)
        return capacity

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    arrival_time: float | None = None, *, prefill_only: bool = False,
                    first_token_id: int | None = None, kv_source: RemoteKV | None = None,
                    output_tokens_in_prompt: int = 0, lora: str | None = None) -> None:
        """Queue a request.

        P/D: `prefill_only` stops after the first token and leases the prompt's blocks (the
        output carries the lease). `first_token_id` continues a request whose first token a
        prefill worker already sampled; with `kv_source` the prompt's KV is pulled from that
        worker instead of computed (falling back to computing it if the pull fails).
        `output_tokens_in_prompt` (a request resumed after its worker failed): the last that many
        prompt tokens are output the client already has (text or not: see _replay_output).
        `lora`: the adapter to serve it with (None: the base model).
        """
        # An aborted request's last output is only given out at the next step: until then its id is still taken,
        # or a caller matching outputs by id would end the new request with it.
        if request_id in self._requests or any(out.request_id == request_id for out in self._abort_outputs):
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"request {request_id!r}: prompt token ids must lie in [0, {vocab})")
        if any(token >= vocab for token, _ in params.logit_bias):
            raise ValueError(f"request {request_id!r}: logit_bias token ids must lie in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model was loaded without one")
        if first_token_id is not None:
            if not 0 <= first_token_id < vocab:
                raise ValueError(f"request {request_id!r}: first_token_id must lie in [0, {vocab})")
            if params.max_tokens < 2:
                raise ValueError(f"request {request_id!r}: nothing left to decode after the first token")
        if output_tokens_in_prompt and (first_token_id is None
                                        or not 0 <= output_tokens_in_prompt < len(prompt_token_ids)):
            raise ValueError(f"request {request_id!r}: output_tokens_in_prompt needs a first_token_id and must be "
                             f"in [0, {len(prompt_token_ids)})")
        if kv_source is not None and first_token_id is None:
            raise ValueError(f"request {request_id!r}: a kv_source needs the first token it was prefilled with")
        if params.prompt_logprobs is not None and (first_token_id is not None or prefill_only):
            raise ValueError(f"request {request_id!r}: prompt logprobs come from a worker that computes the whole "
                             f"prompt and its first token, not from a prefill/decode split")
        if lora is not None and (self.lora is None or lora not in self.lora.paths):
            raise ValueError(f"request {request_id!r}: no LoRA adapter named {lora!r} is loaded")
        matcher = None
        if params.structured is not None:
            output_so_far = [] if first_token_id is None else [
                *prompt_token_ids[len(prompt_token_ids) - output_tokens_in_prompt:], first_token_id]
            matcher = self.grammars.start(params.structured, output_so_far)

        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time, device=self.runner.device)
        prompt_end = len(seq.prompt_token_ids) - output_tokens_in_prompt  # where the client's own prompt ends
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids[:prompt_end], params.stop,
                                                 params.include_stop_str_in_output, params.skip_special_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        if lora is not None:
            seq.lora, seq.hash_seed = lora, adapter_seed(self.hash_seed, self.lora.cache_key(lora))
        seq.prefill_only = prefill_only
        seq.output_tokens_in_prompt = output_tokens_in_prompt
        if first_token_id is not None:
            # The prefill worker (or the failed worker) already sampled it: it is output, not prompt.
            seq.append_token(first_token_id)
            seq.first_token_time = seq.last_token_time = seq.arrival_time
            if detokenizer is not None:
                _replay_output(detokenizer, [*seq.prompt_token_ids[prompt_end:], first_token_id])
            seq.kv_source = kv_source
        self._requests[request_id] = _Request(seq, detokenizer, frozenset(stop_ids), matcher)
        self.scheduler.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
            self.metrics.waiting.set(len(self.scheduler.waiting))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next step() reports it finished with "abort". A prefill
        already done has only its lease left: that is released (a router aborts a prefill only while no decode
        worker has its handle, so nobody is reading those blocks)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            released = self.leases.release_request(request_id)
            if released:
                self._update_gauges()
            return released
        seq = request.seq
        pull = self._pulls.get(request_id)
        if pull is not None:  # the pull thread still writes into its blocks: they are freed when it is done
            pull.orphaned = True
        self.scheduler.abort(request_id, free_blocks=pull is None)
        self._count_finished("abort")
        self._abort_outputs.append(RequestOutput(request_id, [], "", None, True, "abort", seq.num_prompt_tokens,
                                                 seq.num_cached_tokens))
        self._update_gauges()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._abort_outputs) or bool(self._pulls)

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        outputs, self._abort_outputs = self._abort_outputs, []
        self.expire_leases()
        self._import_remote_kv()
        started = time.monotonic()  # the step's own time, from here: a pull waited for above is not the model's
        if self.proposer is not None:
            self._propose()
        scheduled = self.scheduler.schedule()
        now = time.monotonic()
        for seq in scheduled.admitted:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                if self.metrics is not None:
                    self.metrics.queue_time.observe(now - seq.arrival_time)

        if scheduled:
            pairs = sum(attention_pairs(seq.num_computed_tokens, num_new)
                        for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True))
            logits, sample_rows, prompt_logprobs = self.runner.execute(scheduled.seqs, scheduled.num_new_tokens)
            for row, entries in prompt_logprobs.items():
                scheduled.seqs[row].prompt_logprobs.extend(entries)
            computed_prompt = 0
            for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True):
                start = seq.num_computed_tokens
                if start < seq.num_prompt_tokens:
                    computed_prompt += min(start + num_new, seq.num_prompt_tokens) - start
                seq.num_computed_tokens = start + num_new - len(seq.spec_token_ids)  # drafts count once accepted
                # Only now is their K/V in the cache, so only now may other requests find them.
                self.block_manager.cache_computed_blocks(seq)
            if computed_prompt:
                self.num_computed_prompt_tokens += computed_prompt
                if self.metrics is not None:
                    self.metrics.computed_prompt_tokens.inc(computed_prompt)
            if sample_rows:
                outputs += self._sample_and_append(logits, [scheduled.seqs[row] for row in sample_rows])
            ended = time.monotonic()
            self.step_costs.add(scheduled.total_tokens, len(sample_rows), pairs, ended - started)
            self._time_gap(scheduled.total_tokens, len(sample_rows), pairs, ended)
        elif self._pulls and not outputs:
            # Only pulls are left to wait for: wait for one here rather than have the caller spin on empty steps.
            wait([pull.pending for pull in self._pulls.values()], timeout=_PULL_WAIT_S, return_when=FIRST_COMPLETED)

        self._update_gauges()
        return outputs

    def _propose(self) -> None:
        """Draft tokens for the running sequences that decode next (spec_decode.adaptive.draft); the scheduler fits
        them into the step or drops them."""
        draft([seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1], self.proposer,
              self.num_speculative_tokens, self.max_model_len, self.step_costs, self.spec_stats)

    def _sample_and_append(self, logits: torch.Tensor, row_seqs: list[Sequence]) -> list[RequestOutput]:
        """Sample every logits row (a sequence's last known token, then each of its drafts), keep each
        sequence's drafts up to the first its own sample disagrees with, and append what it emits."""
        groups: dict[Sequence, int] = {}  # sequence -> its rows, in row order
        for seq in row_seqs:
            groups[seq] = groups.get(seq, 0) + 1
        offsets = [j for n in groups.values() for j in range(n)]
        requests = self._requests
        histories = None
        if any(s.params.reads_history for s in groups):
            histories = [requests[s.request_id].history(logits.device, s.spec_token_ids[:j])
                         if s.params.reads_history else None for s, j in zip(row_seqs, offsets, strict=True)]
        allowed = None
        if any(s.params.structured is not None for s in groups):  # (such sequences are never drafted for)
            allowed = self.grammars.allowed([requests[s.request_id].matcher for s in row_seqs], logits.device)
        generators = [g for s, n in groups.items() for g in s.token_generators(n)]
        sampled = self.sampler(logits, [s.params for s in row_seqs], generators, histories, allowed)
        now = time.monotonic()
        outputs, row, emitted = [], 0, 0
        for seq, n in groups.items():
            tokens, logprobs = sampled.token_ids[row:row + n], sampled.logprobs[row:row + n]
            row += n
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            if not drafts and seq.spec_history is not None:
                seq.spec_history.check_shadow(tokens[0])
            if drafts:
                accepted = num_accepted(tokens, drafts)
                seq.num_computed_tokens += accepted  # the accepted drafts' K/V is this step's; the rest is rolled back
                self.spec_stats.add(len(drafts), accepted)
                seq.spec_history.record(len(drafts), accepted)
                tokens, logprobs = tokens[:accepted + 1], logprobs[:accepted + 1]
            out = self._append_tokens(seq, tokens, logprobs, now)
            emitted += len(out.new_token_ids)
            outputs.append(out)
            if drafts and not seq.is_finished:
                self.block_manager.cache_computed_blocks(seq)
                self.block_manager.trim(seq)
        self.num_generation_tokens += emitted
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(emitted)
            self.spec_stats.report(self.metrics)
        return outputs

    def _append_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                       now: float) -> RequestOutput:
        """_append_token for each of `token_ids` until one ends the request, as one output."""
        out = self._append_token(seq, token_ids[0], logprobs[0], now)
        for token_id, entry in zip(token_ids[1:], logprobs[1:], strict=True):
            if out.finished:
                break
            more = self._append_token(seq, token_id, entry, now)
            out.new_token_ids += more.new_token_ids
            out.new_text += more.new_text
            if out.new_logprobs is not None:
                out.new_logprobs += more.new_logprobs
            out.finished, out.finish_reason, out.stop_reason = more.finished, more.finish_reason, more.stop_reason
        return out

    def _time_gap(self, tokens: int, sampled: int, pairs: int, ended: float) -> None:
        """Measures the gap since the last step that sampled, as running sequences saw it, against this step's
        predicted time (StepTail); a gap starts only while sequences run (an idle engine's wait is no gap)."""
        cost = self.step_costs.cost()
        if sampled and self._last_step_end is not None and cost is not None:
            predicted = cost.decode_step_s(sampled, pairs) if tokens == sampled else cost.step_s(tokens, sampled, pairs)
            self.step_tail.add(ended - self._last_step_end, predicted)
        self._last_step_end = ended if sampled and self.scheduler.running else None

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
                    result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
                    pending.discard(out.request_id)
        return list(results.values())

    # ----------------------------------------------------------------- LoRA

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (ValueError naming why not)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this worker (--enable-lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving `name`: KeyError if unknown, ValueError while requests use it."""
        if self.lora is None or name not in self.lora.paths:
            raise KeyError(name)
        if any(r.seq.lora == name for r in self._requests.values()):
            raise ValueError(f"the LoRA adapter {name!r} has requests in flight")
        self.lora.remove(name)

    # ----------------------------------------------------------------- P/D

    def release_lease(self, lease_id: str, after_read: bool = False) -> bool:
        """Free a prefill's leased blocks; False if unknown, released or expired (LeaseTable.release: `after_read`)."""
        released = self.leases.release(lease_id, after_read)
        self._update_gauges()
        return released

    def expire_leases(self) -> int:
        expired = self.leases.expire()
        if expired:
            if self.metrics is not None:
                self.metrics.kv_lease_expirations.inc(expired)
            self._update_gauges()
        return expired

    def _import_remote_kv(self) -> None:
        """Pull the prompt KV of waiting P/D requests, so they join the batch as plain decodes. Pulls run one at a
        time (each uses the whole link) on a thread of their own. In the background (config.kv_pull_in_background)
        the steps go on meanwhile, so a decode worker's running requests do not stall while a new one's prompt
        arrives; the scheduler leaves a request alone while its KV is on the way. Otherwise the step waits for
        the pull, and the request joins this step's batch."""
        for seq in self.scheduler.waiting:
            if seq.kv_source is None or seq.request_id in self._pulls:
                continue
            status = self._start_pull(seq, seq.kv_source)
            if status is not None:
                self._settle_pull(seq, status)
        self._end_pulls()

    def _start_pull(self, seq: Sequence, source: RemoteKV) -> str | None:
        """A fallback reason (the prompt is then computed here), or None: the pull is under way, or there is no
        room in the cache for it yet and it is tried again next step."""
        if self.kv_transfer is None:
            return "no_transfer_backend"
        if not _lease_holds(source):
            return "lease_expired"
        bm, num_prompt = self.block_manager, seq.num_prompt_tokens
        # Blocks already in our own prefix cache are not pulled again.
        hits = bm.find_cached_prefix(seq)
        # Room for the first token too (seq.num_tokens: the prompt and the prefill's first token), whose K/V this
        # engine computes next: requests holding pulled prompts and no room for that one slot would wait for each
        # other forever when they fill the cache, since nothing preempts a waiting request.
        if not bm.allocate_slots(seq, seq.num_tokens - len(hits) * bm.block_size, prefix_blocks=hits):
            return None
        num_blocks = bm.blocks_for(num_prompt)
        local, remote = seq.block_table[len(hits):num_blocks], source.block_ids[len(hits):num_blocks]
        if self._pull_thread is None:
            self._pull_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        future = self._pull_thread.submit(_timed_read, self.kv_transfer, source, remote, local,
                                          self.config.kv_pull_timeout_s)
        self._pulls[seq.request_id] = _Pull(seq, source, future, len(local))
        if not self._pull_in_background and sum(not p.future.done() for p in self._pulls.values()) == 1:
            # Bounded: a pull from a worker that just died can hang until its timeout, and every running request
            # would wait with it. Past the bound it goes on in the background, as on a GPU; and a pull queued
            # behind another (one thread: one pull at a time) is not waited for at all, it cannot have begun.
            wait([future], timeout=_STEP_WAIT_FOR_PULL_S)
        return None

    def _end_pulls(self) -> None:
        """Settle the pulls that are over: the request runs as a decode, or computes its prompt here instead."""
        for request_id, pull in list(self._pulls.items()):
            if not pull.future.done():
                continue
            if pull.released is None and pull.source.release is not None and pull.future.exception() is None:
                pull.released = _start_release(pull.source)
                if not self._pull_in_background and not pull.orphaned:  # this step waits for the pull: all of it
                    wait([pull.released], timeout=_STEP_WAIT_FOR_PULL_S)
            if pull.released is not None and not pull.released.done() and not pull.orphaned:
                continue
            del self._pulls[request_id]
            seq = pull.seq
            if pull.orphaned:
                self.block_manager.free(seq)
                continue
            try:
                moved, seconds = pull.future.result()
                if pull.released is not None and pull.released.result() is not True:
                    raise LeaseLost("the lease was no longer held when the read ended: the blocks may be another "
                                    "prompt's")
            except Exception as exc:  # noqa: BLE001 - any backend failure costs this request a recompute, not the engine
                log.warning("KV pull for %s failed, its prompt is computed here: %r", request_id, exc)
                # The blocks stay: the scheduler computes the prompt into them.
                self._settle_pull(seq, "lease_expired" if isinstance(exc, LeaseLost) else "transfer_failed")
                continue
            if not _lease_holds(pull.source):
                # The lease ran out during the read: the prefill worker may have reused the blocks under it, and
                # what arrived may be another request's KV. Computed here instead, into the same blocks.
                self._settle_pull(seq, "lease_expired")
                continue
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.block_manager.cache_computed_blocks(seq)
            self.mean_pull_s += 0.1 * (seconds - self.mean_pull_s)
            if self.metrics is not None:
                self.metrics.kv_transfer_latency.observe(seconds)
                self.metrics.kv_transfer_bytes.inc(moved)
                self.metrics.kv_transfer_blocks.inc(pull.num_blocks)
            self._settle_pull(seq, "pulled")

    def _settle_pull(self, seq: Sequence, status: str) -> None:
        seq.kv_source = None
        self._requests[seq.request_id].kv_status = status
        if status != "pulled" and self.metrics is not None:
            self.metrics.fallback(status)

    # ----------------------------------------------------------------- stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_running_context_tokens(self) -> int:
        """The tokens of the running sequences' contexts: what a decode step's attention reads (read from other
        threads: a copy of the list, whole under the GIL)."""
        return sum(seq.num_tokens for seq in list(self.scheduler.running))

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
        reason = stop_reason = None
        if token_id in request.stop_token_ids:
            reason = "stop"  # the stop token's id is reported, its text is not
            if token_id not in self.eos_token_ids or seq.params.ignore_eos:  # one of the client's stop_token_ids
                stop_reason = token_id
        else:
            if detokenizer is not None:
                text = detokenizer.add_token(token_id)
                if detokenizer.stopped:
                    reason, stop_reason = "stop", detokenizer.matched_stop
            # A finished grammar admits nothing more (its mask holds EOS alone). One that llguidance gave up on
            # midway (a limit of its own, e.g. an automaton too large to build) ends the answer there too.
            matcher = request.matcher
            if reason is None and matcher is not None:
                if not matcher.consume_token(token_id):
                    log.warning("request %s: its grammar failed after %d tokens (%s); ending it", seq.request_id,
                                seq.num_output_tokens, matcher.get_error())
                    reason = "stop"
                elif matcher.is_stopped():
                    reason = "stop"
            if reason is None and (seq.num_output_tokens >= seq.params.max_tokens
                                   or seq.num_tokens >= self.max_model_len):
                reason = "length"
        lease = None
        if reason is None and seq.prefill_only:
            # P/D: pin the prompt's blocks for the decode worker, then retire the sequence (its own
            # references drop, the lease's stay).
            lease = self.leases.pin(seq.request_id, seq.block_table[:self.block_manager.blocks_for(seq.num_prompt_tokens)],
                                    seq.num_prompt_tokens)
            self._finish(seq, "prefill_done", now)
        elif reason is not None:
            if detokenizer is not None:
                text += detokenizer.flush()
            self._finish(seq, reason, now)
        kv_status, request.kv_status = request.kv_status, None
        prompt_logprobs = seq.prompt_logprobs if seq.num_output_tokens == 1 else None
        return RequestOutput(seq.request_id, [token_id], text, None if logprobs is None else [logprobs],
                             reason is not None or lease is not None, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, kv_lease=lease, kv_status=kv_status,
                             prompt_logprobs=prompt_logprobs, stop_reason=stop_reason)

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
        metrics.kv_pinned_blocks.set(self.leases.num_pinned_blocks)
        if bm.num_queried_tokens != self._reported_queried:
            metrics.prefix_queried.inc(bm.num_queried_tokens - self._reported_queried)
            self._reported_queried = bm.num_queried_tokens
        if bm.num_hit_tokens != self._reported_hits:
            metrics.prefix_hit.inc(bm.num_hit_tokens - self._reported_hits)
            self._reported_hits = bm.num_hit_tokens
        if self.scheduler.num_preemptions != self._reported_preemptions:
            metrics.preemptions.inc(self.scheduler.num_preemptions - self._reported_preemptions)
            self._reported_preemptions = self.scheduler.num_preemptions


def _start_release(source: RemoteKV) -> Future:
    """RemoteKV.release's future; one holding the error when it cannot even start (the worker's event loop closed
    as it shuts down), which the pull then settles as a failed transfer rather than the engine's step raising."""
    try:
        return source.release()
    except Exception as exc:  # noqa: BLE001
        failed: Future = Future()
        failed.set_exception(exc)
        return failed


def _timed_read(transfer: KVTransfer, source: RemoteKV, remote: list[int], local: list[int],
                timeout_s: float) -> tuple[int, float]:
    """(bytes moved, seconds): on the pull thread, so the time is the read's own, not when a step noticed it. A
    pull that waited behind others until its lease ran out is not read at all."""
    if not _lease_holds(source):
        raise LeaseLost("the lease ran out before the read began")
    started = time.monotonic()
    moved = transfer.read_blocks(source.agent_info, remote, local, timeout_s, lease_id=source.lease_id)
    return moved, time.monotonic() - started


def _replay_output(detokenizer: IncrementalDetokenizer, output_token_ids: list[int]) -> None:
    """Feed a continued request's output so far through its fresh detokenizer, discarding the text: the worker
    before this one sent that text, except the end it held back in case a stop string began there. The replay
    leaves this detokenizer in the state that worker's was in, that end included, so the end still reaches the
    client, and a stop string that the next tokens complete is still found."""
    for token_id in output_token_ids:
        detokenizer.add_token(token_id)


# How long before its expiry a lease no longer counts: the prefill worker frees the blocks at expires_at on its
# own clock, and the two workers' clocks may differ a little (an allowance for synchronized clocks, not a
# measured skew).
LEASE_MARGIN_S = 0.25


def _lease_holds(source: RemoteKV) -> bool:
    """True while the prefill worker still keeps the blocks: checked before a pull and again after it, since a
    lease that ran out during the read means the blocks may have been reused under it."""
    return source.expires_at - time.time() > LEASE_MARGIN_S
