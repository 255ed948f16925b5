"""Paged KV-cache writes and attention over the paged cache (torch reference path).

Layout and batch conventions are described in metadata.py. The decode-only batch, the common case in
steady-state serving, is one gather of every sequence's blocks per layer (index_select over whole blocks,
which copies contiguous block rows at memcpy speed, unlike advanced indexing) and one batched attention;
prefill chunks are handled one sequence at a time with SDPA, which is where the work is anyway.

Everything derived from the metadata alone (block ids to gather, masks) is the same for all layers of a
step, so it is built once, at the first layer, and kept on the metadata object (see _step_plan).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.workers.layers.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores key/value [T, Hkv, D] into the (strided) per-layer cache views at slot_mapping [T]."""
    block_size = k_cache.shape[1]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    # The per-layer views cannot be flattened to [slots, Hkv, D] (block stride spans all layers), so index
    # by (block, offset); assignment through the view writes the shared cache tensor.
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


@dataclass
class _DecodeBatch:
    """What the batched decode path needs, for one set of sequences with one query token each."""

    token_index: torch.Tensor | None  # rows of the flattened query these sequences own (None: all, in order)
    block_ids: torch.Tensor  # int64 [B * num_blocks]: each sequence's first num_blocks blocks, row-major
    num_seqs: int
    context_len: int  # num_blocks * block_size: the gathered (padded) context length
    max_seq_len: int
    # Additive float32 mask [B, 1, context_len]: 0 where a key is in the sequence, -inf past its end. None
    # for a single sequence, whose context is cut at its length instead.
    mask: torch.Tensor | None


@dataclass
class _StepPlan:
    decode: _DecodeBatch | None
    query_starts: list[int]
    masks: dict  # (seq_len, query_len, dtype) -> the causal-with-offset mask of a prefill chunk


def _decode_batch(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, block_size: int,
    token_index: torch.Tensor | None,
) -> _DecodeBatch:
    num_seqs = block_tables.shape[0]
    num_blocks = -(-max_seq_len // block_size)
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    context_len = num_blocks * block_size
    mask = None
    if num_seqs > 1:
        positions = torch.arange(context_len, device=block_tables.device)
        outside = positions[None, :] >= seq_lens[:, None]
        mask = torch.zeros(num_seqs, 1, context_len, device=block_tables.device)
        mask.masked_fill_(outside.unsqueeze(1), float("-inf"))
    return _DecodeBatch(token_index, block_ids, num_seqs, context_len, max_seq_len, mask)


def _step_plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    """The per-step plan, built at the first layer's call and cached on `meta` for the others."""
    plan = meta.__dict__.get("_attention_plan")
    if plan is not None:
        return plan
    starts = [0, *itertools.accumulate(meta.query_lens_list)]
    decode = None
    if meta.is_decode_only:
        decode = _decode_batch(meta.block_tables, meta.seq_lens, meta.max_seq_len, block_size, None)
    else:
        decode_seqs = [b for b, query_len in enumerate(meta.query_lens_list) if query_len == 1]
        if decode_seqs:
            # Decodes riding along with prefill chunks still go through the batched path.
            device = meta.block_tables.device
            seq_index = torch.tensor(decode_seqs, device=device)
            decode = _decode_batch(
                meta.block_tables.index_select(0, seq_index),
                meta.seq_lens.index_select(0, seq_index),
                max(meta.seq_lens_list[b] for b in decode_seqs),
                block_size,
                torch.tensor([starts[b] for b in decode_seqs], device=device),
            )
    plan = _StepPlan(decode, starts, {})
    meta.__dict__["_attention_plan"] = plan
    return plan


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, Hkv, D]: the listed blocks of one layer's (strided) cache view, in
    order. index_select copies each block's contiguous [block_size, Hkv, D] rows in one go."""
    return cache.index_select(0, block_ids).flatten(0, 1)


def _decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: _DecodeBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = _gather(k_cache, batch.block_ids).view(num_seqs, batch.context_len, num_kv_heads, head_dim)
    values = _gather(v_cache, batch.block_ids).view(num_seqs, batch.context_len, num_kv_heads, head_dim)
    if num_seqs == 1:
        keys, values = keys[:, : batch.max_seq_len], values[:, : batch.max_seq_len]
    if query.dtype != torch.float32:
        # Reduced precision: SDPA's CPU kernel keeps scores and softmax in float32, as HF's SDPA path does.
        # GQA without copying K/V: the query heads sharing one KV head become that head's query rows.
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim)
        mask = None if batch.mask is None else batch.mask.unsqueeze(1).to(query.dtype)
        out = F.scaled_dot_product_attention(
            grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
        )
        return out.reshape(num_seqs, num_heads, head_dim)
    # float32: plain batched GEMMs per KV head on the strided views (no copy), with the mask and scale fused
    # into baddbmm. For a handful of query rows per head this is several times cheaper than the flash
    # kernel, which is built for long query blocks.
    out = torch.empty_like(query)
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        q = query[:, heads]  # [B, G, D]
        k = keys[:, :, h].transpose(1, 2)  # [B, D, S]
        if batch.mask is None:
            scores = torch.bmm(q, k).mul_(scale)
        else:
            scores = torch.baddbmm(batch.mask, q, k, alpha=scale)
        out[:, heads] = torch.bmm(scores.softmax(dim=-1), values[:, :, h])
    return out


def _prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    masks: dict,
) -> torch.Tensor:
    """One sequence's chunk: query [Q, Hq, D] at positions seq_len-Q .. seq_len-1 -> [Q, Hq, D]."""
    query_len, num_heads, _ = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_ids = block_table[: -(-seq_len // block_size)].long()
    keys = _gather(k_cache, block_ids)[:seq_len]  # [S, Hkv, D]
    values = _gather(v_cache, block_ids)[:seq_len]
    group = num_heads // num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    q, k, v = query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if seq_len == query_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Causal with an offset: query i sits at position seq_len - query_len + i and sees every key up to it.
        mask = masks.get((seq_len, query_len))
        if mask is None:
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = masks[(seq_len, query_len)] = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the flattened batch query [T, Hq, D] over each sequence's cached keys (the new
    tokens' K/V must already be written). Returns [T, Hq, D]."""
    plan = _step_plan(meta, k_cache.shape[1])
    if meta.is_decode_only:
        return _decode_attention(query, k_cache, v_cache, plan.decode, scale)

    out = torch.empty_like(query)
    if plan.decode is not None:
        token_index = plan.decode.token_index
        out[token_index] = _decode_attention(query[token_index], k_cache, v_cache, plan.decode, scale)
    starts = plan.query_starts
    for b, query_len in enumerate(meta.query_lens_list):
        if query_len > 1:
            start = starts[b]
            out[start : start + query_len] = _prefill_attention(
                query[start : start + query_len], k_cache, v_cache, meta.block_tables[b], meta.seq_lens_list[b],
                scale, plan.masks,
            )
    return out
