"""Owns the paged KV cache and turns one scheduled step into one forward pass.

The batch is flattened: every scheduled sequence contributes the tokens it computes this step
(one for a decode, a chunk for a prefill), with positions, the cache slot each new K/V goes
to, and the block tables attention reads through (see workers/layers/metadata.py). Logits
are computed only at the last token of sequences that have no token left to compute after
this step (and at each token drafted for speculative decoding); a partial prefill chunk samples nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.workers.engine.cuda_graphs import DecodeGraphs, default_batch_sizes
from tandem.workers.engine.huge_pages import collapse_into_huge_pages
from tandem.workers.engine.sampler import TokenLogprobs, token_logprobs
from tandem.workers.engine.sequence import Sequence
from tandem.workers.layers import kv_quant
from tandem.workers.layers.metadata import AttentionMetadata

log = logging.getLogger(__name__)

_PROMPT_LOGPROBS_ROWS = 64  # prompt positions turned into logits at a time (see ModelRunner.run_step)


def _as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (keys and values)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_dtype(loaded: Any, config: EngineConfig) -> torch.dtype:
    """What the KV cache stores: the model's dtype, or e4m3 for --kv-cache-dtype fp8 (refused on a GPU that has no
    FP8 conversions, below compute capability 8.9)."""
    dtype = kv_quant.kv_cache_torch_dtype(config.kv_cache_dtype, _as_dtype(loaded.dtype))
    device = torch.device(loaded.device)
    if dtype == kv_quant.FP8_KV and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} needs a GPU of compute capability 8.9 or more "
                         f"(FP8 conversions); this one is {torch.cuda.get_device_capability(device)}")
    return dtype


def kv_cache_blocks(loaded: Any, config: EngineConfig) -> int:
    """The number of KV blocks the cache of a runner for `loaded` with `config` has (known before it is made); on a
    tensor-parallel worker each rank's cache holds that many blocks of its own KV heads in kv_cache_memory_gb."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    mc = loaded.config
    kv_heads = getattr(loaded.model, "num_local_kv_heads", mc.num_kv_heads)  # a tensor-parallel rank's own
    block_bytes = kv_block_bytes(mc.num_layers, config.block_size, kv_heads, mc.head_dim, kv_cache_dtype(loaded, config))
    blocks = int(config.kv_cache_memory_gb * (1 << 30)) // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no KV block ({block_bytes} bytes each)")
    return blocks


@dataclass
class StepInputs:
    """One step's flattened batch as plain lists: what rank 0 broadcasts to the other ranks of a tensor-parallel
    worker, each of which makes its own device tensors of it (ModelRunner.tensors)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    logits_indices: list[int]  # flattened tokens whose logits are sampled from
    prompt_spans: list[tuple[int, int]]  # (first flattened token, count) whose logits give prompt logprobs
    lora_slots: list[int] = field(default_factory=list)  # per sequence its adapter's device slot, -1: none


class ModelRunner:
    def __init__(self, loaded: Any, config: EngineConfig, max_model_len: int | None = None):
        """`max_model_len`: the engine's context limit (None: the model's); it sizes the CUDA graphs'
        block tables. On a tensor-parallel worker (loaded.tp) the ranks take rank 0's context limit and cache
        size, and each holds the cache of its own KV heads."""
        self.model = loaded.model
        self.model_config = loaded.config
        self.tp = getattr(loaded, "tp", None)
        self.device = torch.device(loaded.device)
        self.dtype = _as_dtype(loaded.dtype)
        self.block_size = config.block_size
        mc = self.model_config
        self.num_blocks = kv_cache_blocks(loaded, config)
        if self.tp is not None:
            max_model_len, self.num_blocks = self.tp.broadcast((max_model_len, self.num_blocks))
        self.max_model_len = max_model_len
        kv_heads = getattr(self.model, "num_local_kv_heads", mc.num_kv_heads)
        self.kv_dtype = kv_cache_dtype(loaded, config)
        self.kv_cache = torch.zeros(self.num_blocks, mc.num_layers, 2, self.block_size, kv_heads,
                                    mc.head_dim, dtype=self.kv_dtype, device=self.device)
        if self.kv_dtype == kv_quant.FP8_KV:
            scales = self.model.kv_scales() if hasattr(self.model, "kv_scales") else []
            log.info("KV cache in FP8 (e4m3): %d blocks; scales %s", self.num_blocks,
                     "from the checkpoint" if any(s != (1.0, 1.0) for s in scales) else "1.0 (none in the checkpoint)")
        # Pack the CPU GEMM weights now rather than in the middle of the first batched request.
        pack_weights = getattr(self.model, "pack_weights", None)
        if pack_weights is not None:
            pack_weights()
        if self.device.type == "cpu":  # KV pulls from this cache copy page by page: fewer, larger pages
            moved = collapse_into_huge_pages([self.kv_cache])
            log.info("%.0f of %.0f MiB of KV cache on 2 MiB pages", moved / 2**20, self.kv_cache.nbytes / 2**20)
        on_triton_gpu = self.device.type == "cuda" and getattr(self.model.ops, "backend", None) == "triton"
        if on_triton_gpu:
            # Imported here, not at the top: importing a kernel module fixes Triton's mode (compiled or
            # interpreted), which the kernel tests must set first.
            from tandem.workers.kernels.paged_attention import compile_eager_builds

            started = time.perf_counter()
            try:
                launches = compile_eager_builds(self.kv_cache[:, 0, 0], self.kv_cache[:, 0, 1], mc.num_heads, self.dtype)
                log.info("attention kernel: %d eager builds ready in %.1f s", launches, time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - costs each build's compile on its first step, not the worker
                log.warning("compiling the attention kernel's eager builds at start failed; they compile on first "
                            "use: %r", exc)
        self.lora = None  # the engine's LoRAManager when it serves adapters (tandem.workers.lora)
        self.decode_graphs: DecodeGraphs | None = None
        if on_triton_gpu and not config.enforce_eager and not config.enable_lora:
            try:
                self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size,
                                                  max_model_len or mc.max_position_embeddings,
                                                  default_batch_sizes(config.max_num_seqs))
            except RuntimeError as exc:  # a capture CUDA refuses costs speed, not service
                log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]
                ) -> tuple[torch.Tensor | None, list[int], dict[int, list[TokenLogprobs]]]:
        """Run one step. Returns (float32 logits [S, V], the indices into `seqs` of those S rows (a sequence with
        drafted tokens has one row for its last known token and one per draft, in order), and for each row
        whose request wants prompt logprobs, those of the prompt tokens this step's positions predict, in order)."""
        step, sample_rows, prompt_rows = self.prepare(seqs, num_new_tokens)
        if self.tp is not None:
            self.tp.broadcast(step)
        prompt_logprobs: dict[int, list[TokenLogprobs]] = {row: [] for row, _ in prompt_rows}

        def on_prompt_logits(span: int, offset: int, logits: torch.Tensor) -> None:
            row, position = prompt_rows[span]
            seq = seqs[row]
            targets = seq.token_ids[position + 1 + offset:position + 1 + offset + logits.shape[0]]
            prompt_logprobs[row] += token_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))

        logits = self.run_step(step, on_prompt_logits)
        return logits, sample_rows, prompt_logprobs

    @torch.inference_mode()
    def run_step(self, step: StepInputs, on_prompt_logits: Callable[[int, int, torch.Tensor], None] | None = None
                 ) -> torch.Tensor | None:
        """The step's forward pass and its logits: the same calls on every rank of a tensor-parallel worker, whose
        collectives they run together. Prompt logprobs' logits go to `on_prompt_logits(span, offset, logits)` a
        slice of rows at a time: a whole chunk's logits would be [chunk, vocab] float32, gigabytes for a large
        vocabulary, beside a KV cache sized without them. Returns the logits sampled from (None when none is)."""
        input_ids, positions, meta = self.tensors(step)
        if self.lora is not None:
            self.lora.set_step(step.lora_slots, step.query_lens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        for span, (first, count) in enumerate(step.prompt_spans):
            for lo in range(0, count, _PROMPT_LOGPROBS_ROWS):
                logits = self.model.compute_logits(hidden[first + lo:first + min(count, lo + _PROMPT_LOGPROBS_ROWS)])
                if on_prompt_logits is not None:
                    on_prompt_logits(span, lo, logits)
        if not step.logits_indices:
            return None
        if len(step.logits_indices) == hidden.shape[0]:
            last_hidden = hidden
        else:
            last_hidden = hidden[torch.tensor(step.logits_indices, device=self.device)]
        return self.model.compute_logits(last_hidden)

    def tensors(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) of a step, on this runner's device."""
        device = self.device
        width = max(len(table) for table in step.block_tables)
        tables = [table + [0] * (width - len(table)) for table in step.block_tables]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(step.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            query_lens_list=list(step.query_lens),
            seq_lens_list=step.seq_lens,
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
        )
        return (torch.tensor(step.input_ids, dtype=torch.int64, device=device),
                torch.tensor(step.positions, dtype=torch.int64, device=device), meta)

    def prepare(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]
                ) -> tuple[StepInputs, list[int], list[tuple[int, int]]]:
        """Flatten a step into (StepInputs, sample_rows, prompt_rows): prompt_rows (row, first position) go with
        StepInputs.prompt_spans, the positions of rows that want prompt logprobs whose logits predict a prompt token
        not yet recorded (the last prompt position predicts the first output)."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[int, int]] = []
        prompt_rows: list[tuple[int, int]] = []
        for row, (seq, num_new) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            if num_new == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                input_ids.extend(seq.token_ids[start:end])
                if end > seq.num_tokens:  # drafted tokens follow the known ones
                    input_ids.extend(seq.spec_token_ids[:end - seq.num_tokens])
                positions.extend(range(start, end))
                pos = start
                while pos < end:  # one contiguous run of slots per block
                    offset = pos % block_size
                    run = min(block_size - offset, end - pos)
                    first = table[pos // block_size] * block_size + offset
                    slots.extend(range(first, first + run))
                    pos += run
            if seq.prompt_logprobs is not None:
                # Positions whose logits predict a prompt token not yet recorded (a recompute after preemption
                # records nothing twice).
                first = max(start, len(seq.prompt_logprobs) - 1)
                count = min(end, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_spans.append((query_start_loc[-1] + first - start, count))
                    prompt_rows.append((row, first))
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end >= seq.num_tokens:  # the last known token's logits, and each draft's
                num_rows = end - seq.num_tokens + 1
                logits_indices.extend(range(query_start_loc[-1] - num_rows, query_start_loc[-1]))
                sample_rows.extend([row] * num_rows)
        step = StepInputs(input_ids, positions, slots, query_start_loc, seq_lens,
                          [seq.block_table for seq in seqs], list(num_new_tokens), logits_indices, prompt_spans)
        if self.lora is not None:
            placed = self.lora.activate({seq.lora for seq in seqs if seq.lora is not None})
            step.lora_slots = [-1 if seq.lora is None else placed[seq.lora] for seq in seqs]
        return step, sample_rows, prompt_rows
