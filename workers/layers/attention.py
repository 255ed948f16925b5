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

from tandem.workers.layers import kv_quant
from tandem.workers.layers.memo import StepMemo
from tandem.workers.layers.metadata import AttentionMetadata


def _split_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return block_ids, slot_mapping - block_ids * block_size


# Every layer of a step writes the same slots.
_slot_memo = StepMemo()


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores key/value [T, Hkv, D] into the (strided) per-layer cache views at slot_mapping [T]; an FP8 cache
    stores key / k_scale and value / v_scale (kv_quant.quantize)."""
    block_ids, offsets = _slot_memo.get(
        (slot_mapping, k_cache.shape[1]), lambda: _split_slots(slot_mapping, k_cache.shape[1])
    )
    # The per-layer views cannot be flattened to [slots, Hkv, D] (block stride spans all layers), so index
    # by (block, offset); assignment through the view writes the shared cache tensor.
    if kv_quant.is_fp8(k_cache):
        key, value = kv_quant.quantize(key, k_scale), kv_quant.quantize(value, v_scale)
    k_cache[block_ids, offsets] = key if key.dtype == k_cache.dtype else key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value if value.dtype == v_cache.dtype else value.to(v_cache.dtype)


@dataclass
class _DecodeBatch:
    """What the batched decode path needs, for one set of sequences with one query token each."""

    token_index: torch.Tensor | None  # rows of the flattened query these sequences own (None: all, in order)
    block_ids: torch.Tensor  # int64 [B * num_blocks]: each sequence's first num_blocks blocks, row-major
    num_seqs: int
    context_len: int  # num_blocks * block_size: the gathered (padded) context length
    max_seq_len: int
    # Additive mask [B, 1, 1, context_len] per dtype: 0 where a key is in the sequence, -inf past its end.
    # Empty for a single sequence, whose context is cut at its length instead.
    lengths_mask: dict

    def mask_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.num_seqs == 1:
            return None
        mask = self.lengths_mask.get(dtype)
        if mask is None:
            mask = self.lengths_mask[dtype] = self.lengths_mask[torch.float32].to(dtype)
        return mask


@dataclass
class _StepPlan:
    # The step's decodes in groups of similar context length (see _length_groups). A single group with no
    # token_index is the whole step, in order: attended without scattering the output.
    decode_groups: list[_DecodeBatch]
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
    masks = {}
    if num_seqs > 1:
        positions = torch.arange(context_len, device=block_tables.device)
        outside = positions[None, :] >= seq_lens[:, None]
        mask = torch.zeros(num_seqs, 1, 1, context_len, device=block_tables.device)
        masks[torch.float32] = mask.masked_fill_(outside.view(num_seqs, 1, 1, context_len), float("-inf"))
    return _DecodeBatch(token_index, block_ids, num_seqs, context_len, max_seq_len, masks)


# What one more decode group costs per layer (two more gathers and one more attention call on CPU), in padded
# context tokens gathered and attended: the fixed cost of a call over the cost of one more token.
_GROUP_COST_TOKENS = 512


def _length_groups(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Splits sequences (by index) into groups that are gathered and attended together, longest first.

    A group pads every sequence to its longest, and with mixed lengths half of a single group can be
    padding; each extra group costs a fixed overhead instead. The split minimises padded tokens plus that
    overhead, exactly (dynamic programming over the sequences sorted by length; groups start only where the
    padded length changes)."""
    order = sorted(range(len(seq_lens)), key=lambda b: -seq_lens[b])
    padded = [-(-seq_lens[b] // block_size) * block_size for b in order]
    starts = [i for i in range(len(order)) if i == 0 or padded[i] != padded[i - 1]]
    best = [0.0] + [float("inf")] * len(order)  # best[j]: cheapest cover of order[:j]
    cut = [0] * (len(order) + 1)
    for j in [*starts[1:], len(order)]:
        for i in starts:
            if i >= j:
                break
            cost = best[i] + (j - i) * padded[i] + _GROUP_COST_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def _decode_groups(meta: AttentionMetadata, decode_seqs: list[int], starts: list[int], block_size: int):
    device = meta.block_tables.device
    groups = _length_groups([meta.seq_lens_list[b] for b in decode_seqs], block_size)
    if len(groups) == 1 and len(decode_seqs) == len(meta.seq_lens_list):
        return [_decode_batch(meta.block_tables, meta.seq_lens, meta.max_seq_len, block_size, None)]
    batches = []
    for group in groups:
        seqs = [decode_seqs[i] for i in group]
        seq_index = torch.tensor(seqs, device=device)
        batches.append(_decode_batch(
            meta.block_tables.index_select(0, seq_index),
            meta.seq_lens.index_select(0, seq_index),
            max(meta.seq_lens_list[b] for b in seqs),
            block_size,
            torch.tensor([starts[b] for b in seqs], device=device),
        ))
    return batches


def _step_plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    """The per-step plan, built at the first layer's call and cached on `meta` for the others."""
    plan = meta.__dict__.get("_attention_plan")
    if plan is not None:
        return plan
    starts = [0, *itertools.accumulate(meta.query_lens_list)]
    # Decodes riding along with prefill chunks go through the batched path too.
    decode_seqs = [b for b, query_len in enumerate(meta.query_lens_list) if query_len == 1]
    groups = _decode_groups(meta, decode_seqs, starts, block_size) if decode_seqs else []
    plan = _StepPlan(groups, starts, {})
    meta.__dict__["_attention_plan"] = plan
    return plan


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """[len(block_ids) * block_size, Hkv, D] in `dtype`: the listed blocks of one layer's (strided) cache view, in
    order, an FP8 cache's dequantized. index_select copies each block's contiguous [block_size, Hkv, D] rows in one go."""
    rows = cache.index_select(0, block_ids).flatten(0, 1)
    return rows if rows.dtype == dtype else kv_quant.dequantize(rows, kv_scale, dtype)


def _decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: _DecodeBatch, scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    keys = _gather(k_cache, batch.block_ids, query.dtype, kv_scales[0])
    values = _gather(v_cache, batch.block_ids, query.dtype, kv_scales[1])
    keys = keys.view(num_seqs, batch.context_len, num_kv_heads, head_dim)
    values = values.view(num_seqs, batch.context_len, num_kv_heads, head_dim)
    if num_seqs == 1:
        keys, values = keys[:, : batch.max_seq_len], values[:, : batch.max_seq_len]
    # GQA without copying K/V: the query heads sharing one KV head become that head's query rows. SDPA's
    # CPU kernel reads the token-major gathered K/V through strides, and keeps scores and softmax in float32
    # for reduced-precision inputs, as transformers' SDPA path does.
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask_for(query.dtype), scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _causal_mask(masks: dict, seq_len: int, query_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [Q, S], cached per step and dtype: query i (at position seq_len - Q + i) sees every key
    up to its own position."""
    key = (seq_len, query_len, dtype)
    mask = masks.get(key)
    if mask is None:
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        future = key_pos[None, :] > query_pos[:, None]
        mask = torch.zeros(query_len, seq_len, device=device).masked_fill_(future, float("-inf"))
        mask = masks[key] = mask.to(dtype)
    return mask


def _prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    masks: dict,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One sequence's chunk: query [Q, Hq, D] at positions seq_len-Q .. seq_len-1 -> [Q, Hq, D]."""
    query_len, num_heads, _ = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_ids = block_table[: -(-seq_len // block_size)].long()
    keys = _gather(k_cache, block_ids, query.dtype, kv_scales[0])[:seq_len]  # [S, Hkv, D]
    values = _gather(v_cache, block_ids, query.dtype, kv_scales[1])[:seq_len]
    # 4-D [1, H, len, D] views: with 3-D inputs SDPA takes its unfused math path on CPU, several times slower
    # than the flash kernel (which also keeps bf16 scores and softmax in float32).
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if seq_len == query_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = _causal_mask(masks, seq_len, query_len, query.dtype, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the flattened batch query [T, Hq, D] over each sequence's cached keys (the new
    tokens' K/V must already be written). Returns [T, Hq, D]. `softcap`: scores become softcap * tanh(s / softcap)
    (Gemma 2); `window`: a query sees only the last `window` positions, its own included (sliding-window layers).
    An FP8 cache is read as k_cache * k_scale and v_cache * v_scale."""
    kv_scales = (k_scale, v_scale)
    if softcap is not None or window is not None:
        return _eager_attention(query, k_cache, v_cache, meta, scale, softcap, window, kv_scales)
    plan = _step_plan(meta, k_cache.shape[1])
    groups = plan.decode_groups
    if len(groups) == 1 and groups[0].token_index is None:
        return _decode_attention(query, k_cache, v_cache, groups[0], scale, kv_scales)

    out = torch.empty_like(query)
    for group in groups:
        out[group.token_index] = _decode_attention(query[group.token_index], k_cache, v_cache, group, scale,
                                                   kv_scales)
    attend_prefill_chunks(out, query, k_cache, v_cache, meta, scale, plan.query_starts, plan.masks, kv_scales)
    return out


def attend_prefill_chunks(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, query_starts: list[int], masks: dict,
                          kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Writes into `out` the attention of every sequence of the step that brings more than one token (a
    prefill chunk), one sequence at a time; decode rows are left to the caller."""
    for b, query_len in enumerate(meta.query_lens_list):
        if query_len > 1:
            start = query_starts[b]
            out[start : start + query_len] = _prefill_attention(
                query[start : start + query_len], k_cache, v_cache, meta.block_tables[b], meta.seq_lens_list[b],
                scale, masks, kv_scales,
            )


def _eager_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, softcap: float | None, window: int | None,
                     kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """paged_attention with soft-capped scores and/or a sliding window, one sequence at a time, scores made
    explicitly (SDPA caps nothing), in transformers' eager order: scale, cap, mask, float32 softmax."""
    out = torch.empty_like(query)
    num_kv_heads = k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    start = 0
    plan = _eager_plan(meta, k_cache.shape[1], window, query.device)
    for query_len, seq_len, (block_ids, first_key, hidden) in zip(meta.query_lens_list, meta.seq_lens_list, plan):
        keys = _gather(k_cache, block_ids, query.dtype, kv_scales[0])[first_key:seq_len]
        values = _gather(v_cache, block_ids, query.dtype, kv_scales[1])[first_key:seq_len]
        keys = keys.transpose(0, 1).repeat_interleave(group, 0)
        values = values.transpose(0, 1).repeat_interleave(group, 0)
        q = query[start : start + query_len].transpose(0, 1)  # [Hq, Q, D]
        scores = (q @ keys.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        out[start : start + query_len] = (probs @ values).transpose(0, 1)
        start += query_len
    return out


def _eager_plan(meta: AttentionMetadata, block_size: int, window: int | None,
                device: torch.device) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """_eager_attention's per-sequence (blocks, first key in reach, mask of the keys each query row may not see),
    the same for every layer of a step: built at the first layer's call and cached on `meta` for the others, one
    per window (a model's sliding-window and global layers alternate)."""
    plans = meta.__dict__.setdefault("_eager_attention_plans", {})
    plan = plans.get((block_size, window))
    if plan is not None:
        return plan
    plan = []
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        first_key = 0 if window is None else max(0, seq_len - query_len - window + 1)  # older keys are out of reach
        block_ids = meta.block_tables[b, : -(-seq_len // block_size)].long()
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
        key_pos = torch.arange(first_key, seq_len, device=device)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        plan.append((block_ids, first_key, hidden))
    plans[(block_size, window)] = plan
    return plan
