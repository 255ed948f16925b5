"""Paged attention for CPU workers: decode tokens through a small C++ kernel, prefill chunks through SDPA.

The kernel (csrc/paged_decode_cpu.cpp) reads each sequence's keys and values in place from the paged cache,
where the torch reference path (layers/attention.py) first gathers them into a contiguous copy and pads
mixed lengths; benchmarks/engine_cpu.py (c) times the two.

It is part of the native CPU extension (cpu_extension.py), built once per machine. The engine's "auto"
attention backend falls back to the torch path when it did not build (no compiler, say), so a worker never
fails for want of it. The kernel reads float caches only: an FP8 cache (--kv-cache-dtype fp8) takes the torch path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tandem.workers.kernels import cpu_extension
from tandem.workers.layers import attention, kv_quant
from tandem.workers.layers.metadata import AttentionMetadata


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, Hq, D], one token per sequence at position seq_lens[b] - 1 -> [B, Hq, D]."""
    return cpu_extension.load().paged_decode_attention(query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)


@dataclass
class _StepPlan:
    """What every layer of a step shares, built at the first layer (see _step_plan)."""

    decode_rows: torch.Tensor | None  # query rows of the decode sequences; None: the whole step is decodes
    block_tables: torch.Tensor | None  # int32 [decodes, max_blocks], None when the step has no decode
    seq_lens: torch.Tensor | None  # int32 [decodes]
    query_starts: list[int]
    masks: dict = field(default_factory=dict)  # prefill chunks' causal masks, see attention.attend_prefill_chunks


def _step_plan(meta: AttentionMetadata) -> _StepPlan:
    plan = meta.__dict__.get("_cpu_attention_plan")
    if plan is None:
        starts = [0, *itertools.accumulate(meta.query_lens_list)]
        decodes = [b for b, query_len in enumerate(meta.query_lens_list) if query_len == 1]
        if len(decodes) == len(starts) - 1:
            plan = _StepPlan(None, meta.block_tables.contiguous(), meta.seq_lens.contiguous(), starts)
        elif decodes:
            seqs = torch.tensor(decodes)
            plan = _StepPlan(torch.tensor([starts[b] for b in decodes]),
                             meta.block_tables.index_select(0, seqs).contiguous(),
                             meta.seq_lens.index_select(0, seqs).contiguous(), starts)
        else:
            plan = _StepPlan(None, None, None, starts)
        meta.__dict__["_cpu_attention_plan"] = plan
    return plan


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Same contract as layers.attention.paged_attention: query [T, Hq, D] -> [T, Hq, D]."""
    if kv_quant.is_fp8(k_cache):
        return attention.paged_attention(query, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    plan = _step_plan(meta)
    if plan.block_tables is not None and plan.decode_rows is None:
        return paged_decode_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
    out = torch.empty_like(query)
    if plan.block_tables is not None:
        out[plan.decode_rows] = paged_decode_attention(
            query.index_select(0, plan.decode_rows), k_cache, v_cache, plan.block_tables, plan.seq_lens, scale
        )
    attention.attend_prefill_chunks(out, query, k_cache, v_cache, meta, scale, plan.query_starts, plan.masks)
    return out
