"""Paged KV-cache writes and attention over the paged cache (torch reference path).

Layout and batch conventions are described in metadata.py. The decode-only batch, the common case in
steady-state serving, is one gather and one batched SDPA call; prefill chunks are handled one sequence at
a time with SDPA, which is where the work is anyway.
"""

from __future__ import annotations

import itertools

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


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[..., num_blocks * block_size, Hkv, D] keys or values of the first num_blocks blocks of block_table."""
    gathered = cache[block_table[..., :num_blocks]]  # [..., num_blocks, block_size, Hkv, D]
    return gathered.flatten(-4, -3)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    keys = _gather_context(k_cache, block_tables, num_blocks).transpose(1, 2)  # [B, Hkv, S, D]
    values = _gather_context(v_cache, block_tables, num_blocks).transpose(1, 2)
    if num_seqs == 1:
        # Batch-1 decode needs no mask: cut the context at the sequence length instead.
        keys, values, mask = keys[:, :, :max_seq_len], values[:, :, :max_seq_len], None
    else:
        positions = torch.arange(keys.shape[2], device=query.device)
        mask = (positions[None, :] < seq_lens[:, None]).view(num_seqs, 1, 1, -1)
    # GQA without copying K/V: the query heads sharing one KV head become that head's query rows.
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk: query [Q, Hq, D] at positions seq_len-Q .. seq_len-1 -> [Q, Hq, D]."""
    query_len, num_heads, _ = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    keys = _gather_context(k_cache, block_table, num_blocks)[:seq_len]  # [S, Hkv, D]
    values = _gather_context(v_cache, block_table, num_blocks)[:seq_len]
    group = num_heads // num_kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    q, k, v = query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if seq_len == query_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Causal with an offset: query i sits at position seq_len - query_len + i and sees every key up to it.
        key_pos = torch.arange(seq_len, device=query.device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
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
    block_tables = meta.block_tables.long()
    if meta.is_decode_only:
        return _decode_attention(query, k_cache, v_cache, block_tables, meta.seq_lens, meta.max_seq_len, scale)

    out = torch.empty_like(query)
    starts = [0, *itertools.accumulate(meta.query_lens_list)]
    decode_seqs = [b for b, query_len in enumerate(meta.query_lens_list) if query_len == 1]
    if decode_seqs:
        # Decodes riding along with a prefill chunk still go through the batched path.
        seq_index = torch.tensor(decode_seqs, device=query.device)
        token_index = torch.tensor([starts[b] for b in decode_seqs], device=query.device)
        out[token_index] = _decode_attention(
            query[token_index],
            k_cache,
            v_cache,
            block_tables[seq_index],
            meta.seq_lens.index_select(0, seq_index),
            max(meta.seq_lens_list[b] for b in decode_seqs),
            scale,
        )
    for b, query_len in enumerate(meta.query_lens_list):
        if query_len > 1:
            start = starts[b]
            out[start : start + query_len] = _prefill_attention(
                query[start : start + query_len], k_cache, v_cache, block_tables[b], meta.seq_lens_list[b], scale
            )
    return out
