"""Owns the paged KV cache and turns one scheduled step into one forward pass.

The batch is flattened: every scheduled sequence contributes the tokens it computes this step
(one for a decode, a chunk for a prefill), with positions, the cache slot each new K/V goes
to, and the block tables attention reads through (see workers/layers/metadata.py). Logits
are computed only at the last token of sequences that have no token left to compute after
this step; a partial prefill chunk samples nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from tandem.config import EngineConfig
from tandem.workers.engine.cuda_graphs import DecodeGraphs, default_batch_sizes
from tandem.workers.engine.huge_pages import collapse_into_huge_pages
from tandem.workers.engine.sampler import TokenLogprobs, token_logprobs
from tandem.workers.engine.sequence import Sequence
from tandem.workers.layers.metadata import AttentionMetadata

log = logging.getLogger(__name__)

_PROMPT_LOGPROBS_ROWS = 64  # prompt positions turned into logits at a time (see ModelRunner._prompt_logprobs)


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


def kv_cache_blocks(loaded: Any, config: EngineConfig) -> int:
    """The number of KV blocks the cache of a runner for `loaded` with `config` has (known before it is made)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    mc = loaded.config
    block_bytes = kv_block_bytes(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim,
                                 _as_dtype(loaded.dtype))
    blocks = int(config.kv_cache_memory_gb * (1 << 30)) // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no KV block ({block_bytes} bytes each)")
    return blocks


class ModelRunner:
    def __init__(self, loaded: Any, config: EngineConfig, max_model_len: int | None = None):
        """`max_model_len`: the engine's context limit (None: the model's); it sizes the CUDA graphs'
        block tables."""
        self.model = loaded.model
        self.model_config = loaded.config
        self.device = torch.device(loaded.device)
        self.dtype = _as_dtype(loaded.dtype)
        self.block_size = config.block_size
        mc = self.model_config
        self.num_blocks = kv_cache_blocks(loaded, config)
        self.kv_cache = torch.zeros(self.num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
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
                launches = compile_eager_builds(self.kv_cache[:, 0, 0], self.kv_cache[:, 0, 1], mc.num_heads)
                log.info("attention kernel: %d eager builds ready in %.1f s", launches, time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - costs each build's compile on its first step, not the worker
                log.warning("compiling the attention kernel's eager builds at start failed; they compile on first "
                            "use: %r", exc)
        self.decode_graphs: DecodeGraphs | None = None
        if on_triton_gpu and not config.enforce_eager:
            try:
                self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size,
                                                  max_model_len or mc.max_position_embeddings,
                                                  default_batch_sizes(config.max_num_seqs))
            except RuntimeError as exc:  # a capture CUDA refuses costs speed, not service
                log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]
                ) -> tuple[torch.Tensor | None, list[int], dict[int, list[TokenLogprobs]]]:
        """Run one step. Returns (float32 logits [S, V], the indices into `seqs` of those S rows, and for each row
        whose request wants prompt logprobs, those of the prompt tokens this step's positions predict, in order)."""
        input_ids, positions, meta, logits_indices, sample_rows, prompt_spans = self.prepare(seqs, num_new_tokens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            hidden = self.decode_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        prompt_logprobs = {row: self._prompt_logprobs(hidden[first:first + count], seqs[row], position)
                           for row, first, count, position in prompt_spans}
        if not sample_rows:
            return None, sample_rows, prompt_logprobs
        if len(logits_indices) == hidden.shape[0]:
            last_hidden = hidden
        else:
            last_hidden = hidden[torch.tensor(logits_indices, device=self.device)]
        return self.model.compute_logits(last_hidden), sample_rows, prompt_logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, position: int) -> list[TokenLogprobs]:
        """The logprobs of the prompt tokens that hidden rows at positions position, position + 1, ... predict,
        each with params.prompt_logprobs alternatives (of the raw distribution, as the sampler reports an output
        token's). A slice of rows at a time: a whole chunk's logits would be [chunk, vocab] float32, gigabytes for a
        large vocabulary, beside a KV cache sized without them."""
        entries = []
        for lo in range(0, hidden.shape[0], _PROMPT_LOGPROBS_ROWS):
            logits = self.model.compute_logits(hidden[lo:lo + _PROMPT_LOGPROBS_ROWS])
            targets = seq.token_ids[position + 1 + lo:position + 1 + lo + logits.shape[0]]
            entries += token_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))
        return entries

    def prepare(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]):
        """Flatten a step into (input_ids, positions, AttentionMetadata, logits_indices, sample_rows, prompt_spans):
        prompt_spans (row, first index into the flattened tokens, count, first position) are the positions of rows
        that want prompt logprobs whose logits predict a prompt token not yet recorded (the last prompt position
        predicts the first output)."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[int, int, int]] = []
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
                    prompt_spans.append((row, query_start_loc[-1] + first - start, count, first))
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sample_rows.append(row)

        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            query_lens_list=list(num_new_tokens),
            seq_lens_list=seq_lens,
            max_query_len=max(num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return (torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                meta, logits_indices, sample_rows, prompt_spans)
