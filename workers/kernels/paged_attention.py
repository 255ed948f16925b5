"""Paged attention for a flattened varlen batch of prefill chunks and decodes, in Triton.

One kernel for every step, with a split-KV (flash-decoding) variant for long contexts at small batch. The
tiling and how tiles are numbered without the host: docs/design/engine.md.

An FP8 cache (--kv-cache-dtype fp8) is dequantized on load: its tiles widen exactly to the query's dtype (e4m3
values are float16/bfloat16/float32 values), k_scale multiplies the scores (folded into their scale) and v_scale
the output, in float32: the same products as dequantizing each element first.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable
from tandem.workers.layers.kv_quant import is_fp8
from tandem.workers.layers.metadata import AttentionMetadata

LOG2_E = 1.0 / math.log(2.0)  # scores live in the log2 domain so the kernel can use exp2

# Split-KV heuristic: split when one KV-split-free launch would give fewer programs than
# _SPLIT_TARGET_PROGRAMS_PER_SM per SM, keeping at least _MIN_KEYS_PER_SPLIT keys per split.
_SPLIT_TARGET_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 32


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile id (query_start_loc[b] // BLOCK_Q + b) is <= tile_id."""
    lo = tile_id * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_kv_tiles(
    acc,
    running_max,
    running_sum,
    q,
    tile_begin,
    tile_end,
    kv_len,
    row_position,
    block_table_row,
    k_head_ptr,
    v_head_ptr,
    dims,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online-softmax update over KV tiles [tile_begin, tile_end); CAUSAL masks keys past each row's
    position and past kv_len (tiles before the diagonal skip both)."""
    key_in_tile = tl.arange(0, TILE_N)
    dim_valid = dims < HEAD_DIM
    for kv_tile in range(tile_begin, tile_end):
        key_position = kv_tile * TILE_N + key_in_tile
        if CAUSAL:
            key_valid = key_position < kv_len
        else:
            key_valid = key_in_tile < TILE_N
        # Every key finds its own block, so a tile may span several cache blocks.
        block = tl.load(block_table_row + key_position // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_in_block = key_position % BLOCK_SIZE

        k_offsets = block * stride_kb + slot_in_block * stride_ks
        k_t = tl.load(
            k_head_ptr + k_offsets[None, :] + dims[:, None] * stride_kd,
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        if KV_FP8:
            k_t = k_t.to(q.dtype)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = (key_position[None, :] <= row_position[:, None]) & key_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max

        v_offsets = block * stride_vb + slot_in_block * stride_vs
        v = tl.load(
            v_head_ptr + v_offsets[:, None] + dims[None, :] * stride_vd,
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * rescale[:, None]
        acc = tl.dot(probs.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
    return acc, running_max, running_sum


# num_seqs and the block table's row stride change from step to step; Triton would otherwise compile a variant
# for each of their value classes (1, a multiple of 16, other), and each compile stalls the engine's step on a
# serving host. Neither feeds a vectorized access, so nothing is lost by not specializing.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    v_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_pt,
    stride_ph,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        # One token per sequence: tile b is sequence b, and the grid is exactly num_seqs wide.
        seq = tile_id
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = 1
        tile_q_start = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        tile_q_start = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if tile_q_start >= query_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    # Row r of the tile is query token r // QUERIES_PER_KV, head r % QUERIES_PER_KV of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    row_token = tile_q_start + rows // QUERIES_PER_KV
    row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (row_token < query_len)
    row_position = prefix_len + row_token
    row_flat_token = (q_start + row_token).to(tl.int64)

    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q_offsets = (
        row_flat_token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # The tile's last query token sees every key before it; no row sees past seq_len.
    kv_len = tl.minimum(seq_len, prefix_len + tile_q_start + BLOCK_Q)
    num_kv_tiles = tl.cdiv(kv_len, TILE_N)
    if NUM_SPLITS == 1:
        kv_tile_begin = 0
        kv_tile_end = num_kv_tiles
    else:
        tiles_per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
        kv_tile_begin = split * tiles_per_split
        kv_tile_end = tl.minimum(kv_tile_begin + tiles_per_split, num_kv_tiles)

    # A finite floor (not -inf) keeps fully masked rows NaN-free: their weights come out as 0.
    running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    if not DECODE_ONLY:
        # KV tiles wholly at or before the tile's first query position need no causal mask; only the
        # last few (the diagonal) do. (Decode-only launches skip this: memory-bound, they gain nothing
        # from it, and a second loop costs registers and so occupancy.)
        num_unmasked_tiles = (prefix_len + tile_q_start + 1) // TILE_N
        acc, running_max, running_sum = _attend_kv_tiles(
            acc, running_max, running_sum, q, kv_tile_begin, tl.minimum(kv_tile_end, num_unmasked_tiles),
            kv_len, row_position, block_table_row, k_head_ptr, v_head_ptr, dims, scale_log2,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            BLOCK_SIZE, HEAD_DIM, TILE_N, DOT_PRECISION, False, KV_FP8,
        )  # fmt: skip
        kv_tile_begin = tl.maximum(kv_tile_begin, num_unmasked_tiles)
    acc, running_max, running_sum = _attend_kv_tiles(
        acc, running_max, running_sum, q, kv_tile_begin, kv_tile_end,
        kv_len, row_position, block_table_row, k_head_ptr, v_head_ptr, dims, scale_log2,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        BLOCK_SIZE, HEAD_DIM, TILE_N, DOT_PRECISION, True, KV_FP8,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale  # the output is linear in the values

    if NUM_SPLITS == 1:
        safe_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
        result = acc / safe_sum[:, None]
        out_offsets = (
            row_flat_token[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :] * stride_od
        )
        tl.store(
            out_ptr + out_offsets,
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # Partials are [T, Hq, NUM_SPLITS, HEAD_DIM_PADDED] (sums/maxes without the last axis), contiguous.
        part_row = row_flat_token * stride_pt + row_head * stride_ph + split
        tl.store(part_max_ptr + part_row, running_max, mask=row_valid)
        tl.store(part_sum_ptr + part_row, running_sum, mask=row_valid)
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pt,
    stride_ph,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PADDED)

    part_row = token * stride_pt + head * stride_ph + splits
    split_max = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    split_acc = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    weight = tl.exp2(split_max - tl.max(split_max, axis=0))
    total = tl.sum(split_sum * weight, axis=0)
    result = tl.sum(split_acc * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile_config(max_query_len: int, queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Block shapes and launch options.

    Decode-only batches get 1-token tiles: they are memory-bound, and BLOCK_M only needs to reach the
    16 rows a tensor-core dot wants. Prefill tiles are 64 rows for the tensor cores; float32
    (exact "ieee" dots, no tensor cores) gets smaller tiles so that the accumulators stay in registers.
    """
    min_rows = triton.next_power_of_2(queries_per_kv)
    if max_query_len == 1:
        block_m = max(16, min_rows)
        return dict(BLOCK_M=block_m, BLOCK_Q=1, TILE_N=64, num_warps=4, num_stages=3)
    if dtype == torch.float32:
        block_m = max(32 if head_dim > 64 else 64, min_rows)
        tile_n = 16 if head_dim > 64 else 32
        return dict(
            BLOCK_M=block_m, BLOCK_Q=block_m // queries_per_kv, TILE_N=tile_n, num_warps=8, num_stages=2
        )
    # 64-row tiles beat 128-row ones on an H200 for both a 4,096-token prefill and the engine's 16 x 512-token
    # step (benchmarks/kernels_gpu_sweep.py: 425 vs 474 us and 178 vs 205 us), with the same 64-key tiles.
    block_m = max(64, min_rows)
    num_warps = 8 if block_m >= 128 else 4
    return dict(
        BLOCK_M=block_m, BLOCK_Q=block_m // queries_per_kv, TILE_N=64, num_warps=num_warps, num_stages=2
    )


def choose_num_splits(
    num_tiles: int, num_kv_heads: int, max_seq_len: int, device: torch.device, tile_n: int = 64
) -> int:
    """How many KV ranges to split each tile's keys into (1 = no split).

    Split only when a plain launch (num_tiles x num_kv_heads programs) would fill fewer than
    _SPLIT_TARGET_PROGRAMS_PER_SM programs per SM and the context is long enough that each split still
    streams at least _MIN_KEYS_PER_SPLIT keys; the merge kernel then costs little next to the gain.
    The count is a power of two: each count is a kernel variant of its own (NUM_SPLITS is a compile-time
    constant), and eager steps of ever-changing batches would otherwise compile up to _MAX_SPLITS of them.
    """
    if device.type != "cuda":
        return 1
    programs = max(1, num_tiles * num_kv_heads)
    target = _SPLIT_TARGET_PROGRAMS_PER_SM * _sm_count(device)
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, programs)
    by_length = max_seq_len // max(_MIN_KEYS_PER_SPLIT, tile_n)
    # Rounded up (_MAX_SPLITS is a power of two): a few more splits than needed add only merge work, a few fewer
    # leave SMs idle. (docs/benchmarks.md: the 32-split decode at 32,768 keys measured slower on an H200 after
    # this change and do_not_specialize than before; which of the two costs it is not yet measured.)
    return triton.next_power_of_2(max(1, min(by_occupancy, by_length, _MAX_SPLITS)))


def _grid_tiles(meta: AttentionMetadata, num_tokens: int, block_q: int) -> int:
    """Programs along the kernel's first grid axis: one per sequence for decodes, else an upper bound on the
    query tiles (each program finds its own tile by binary search; the extra ones exit at once)."""
    return meta.num_seqs if meta.max_query_len == 1 else num_tokens // block_q + meta.num_seqs


def default_num_splits(query: torch.Tensor, num_kv_heads: int, meta: AttentionMetadata, device: torch.device) -> int:
    """The split count paged_attention picks for this batch when none is given, for `device` (the query's; the
    compile check asks for a GPU's with CPU tensors)."""
    config = _tile_config(meta.max_query_len, query.shape[1] // num_kv_heads, query.shape[2], query.dtype)
    block_q = config["BLOCK_Q"]
    real_tiles = min(_grid_tiles(meta, query.shape[0], block_q), meta.num_seqs * triton.cdiv(meta.max_query_len, block_q))
    return choose_num_splits(real_tiles, num_kv_heads, meta.max_seq_len, device, config["TILE_N"])


def _validate(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, q_heads, head_dim], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query has {head_dim}, the KV cache {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_cache.dtype != v_cache.dtype or (k_cache.dtype != query.dtype and not is_fp8(k_cache)):
        raise ValueError(f"KV cache dtype {k_cache.dtype} differs from query dtype {query.dtype}")
    devices = {query.device, k_cache.device, v_cache.device, meta.block_tables.device, meta.seq_lens.device}
    if len(devices) != 1 or meta.query_start_loc.device != query.device:
        raise ValueError("query, KV cache and attention metadata must be on one device")
    num_seqs = meta.num_seqs
    if meta.query_start_loc.shape != (num_seqs + 1,) or meta.seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"metadata disagrees on the number of sequences: {num_seqs} host seq_lens, query_start_loc "
            f"{tuple(meta.query_start_loc.shape)}, seq_lens {tuple(meta.seq_lens.shape)}"
        )
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [{num_seqs}, max_blocks], got {tuple(meta.block_tables.shape)}"
        )
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        if getattr(meta, name).dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {getattr(meta, name).dtype}")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention of query [T, Hq, D] over the cache; returns [T, Hq, D] in query's dtype.

    k_cache / v_cache are [num_blocks, block_size, Hkv, D] views (any strides, e.g. kv_cache[:, layer, 0]), in the
    query's dtype or FP8 (read as k_cache * k_scale, v_cache * v_scale).
    num_splits forces the split-KV path's split count (1 disables it); None lets choose_num_splits pick.
    Rows of tokens past query_start_loc[-1] (padding, e.g. for a CUDA graph) come out undefined.
    """
    _validate(query, k_cache, v_cache, meta)
    check_runnable(_paged_attention_kernel, query, "paged_attention")
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out

    config = _tile_config(meta.max_query_len, queries_per_kv, head_dim, query.dtype)
    decode_only = meta.max_query_len == 1
    kv_fp8 = is_fp8(k_cache)
    grid_tiles = _grid_tiles(meta, num_tokens, config["BLOCK_Q"])
    if num_splits is None:
        num_splits = default_num_splits(query, num_kv_heads, meta, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    head_dim_padded = max(16, triton.next_power_of_2(head_dim))  # tl.dot wants K >= 16
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim_padded), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_strides = (part_max.stride(0), part_max.stride(1))
    else:
        part_out = part_max = part_sum = out  # unused: the NUM_SPLITS == 1 branch is compiled out
        part_strides = (0, 0)

    _paged_attention_kernel[(grid_tiles, num_kv_heads, num_splits)](
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        part_out,
        part_max,
        part_sum,
        scale * LOG2_E * (k_scale if kv_fp8 else 1.0),
        float(v_scale),
        num_seqs,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        meta.block_tables.stride(0),
        *part_strides,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        NUM_SPLITS=num_splits,
        DECODE_ONLY=decode_only,
        # fp32 inputs would otherwise run through TF32 tensor cores and lose precision.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        **config,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            *out.stride(),
            *part_strides,
            NUM_SPLITS=num_splits,
            SPLITS_PADDED=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            num_warps=4,
        )
    return out


def compile_eager_builds(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                         dtype: torch.dtype | None = None) -> int:
    """Compiles, before serving, every build of the attention kernel that an eager step can ask for.

    Decode-only steps of up to the largest CUDA graph replay graphs, whose builds their capture compiled.
    Other steps (prefills, mixed batches, larger decode batches) launch eagerly, and a build is fixed by
    what the model fixes (head counts, head dim, block size, dtype, strides) plus two things a step decides:
    decode-only or prefill tiles, and the split count (a power of two up to _MAX_SPLITS). One tiny launch of
    each pair compiles them all here, rather than on a serving step (where each compile would stall it).
    The launches read one block of the cache and write a scratch output. Returns the number of launches.
    `dtype`: the queries' (the cache's when None; an FP8 cache needs it).
    """
    device, dtype = k_cache.device, dtype or k_cache.dtype
    head_dim = k_cache.shape[3]
    launches = 0
    for query_len in (1, 2):  # decode-only tiles, then prefill tiles (_tile_config: the same for any longer query)
        splits = 1
        while splits <= _MAX_SPLITS:
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(query_len, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
                block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                query_lens_list=[query_len], seq_lens_list=[query_len], max_query_len=query_len,
                max_seq_len=query_len,
            )  # fmt: skip
            query = torch.zeros(query_len, num_q_heads, head_dim, dtype=dtype, device=device)
            paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5, num_splits=splits)
            launches += 1
            splits *= 2
    return launches


__all__ = ["paged_attention", "choose_num_splits", "compile_eager_builds"]
