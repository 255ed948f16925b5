"""Fused mixture-of-experts in Triton: the (token, expert) pairs sorted and grouped by expert, each group padded to
a row tile, and one grouped-GEMM kernel run twice (gate|up, then down with the routing weight folded in).

The torch reference (tandem.workers.layers.moe.fused_moe) runs the same arithmetic expert by expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable
from tandem.workers.kernels.activation import silu_and_mul


@triton.jit
def _grouped_gemm_kernel(y_ptr, x_ptr, w_ptr, pair_ptr, tile_expert_ptr, weight_ptr, num_pairs, N, K, stride_y,
                         stride_x, stride_we, stride_wn, X_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Row tile `pid_m` holds pairs of one expert (pair_ptr: pair index, or num_pairs for padding); pair p reads row
    # p // X_ROW_DIV of x and writes row p of y.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    x_rows = (pairs // X_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_rows[:, None] * stride_x + ks[None, :], mask=valid[:, None] & (ks[None, :] < K),
                    other=0.0)
        # The expert's weight is [N, K] row-major: a [BLOCK_K, BLOCK_N] tile of its transpose.
        w = tl.load(w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:  # float32: a float32 product, not TF32's
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices sorted by expert, each expert's run padded with num_pairs to a multiple of block_m;
    the expert of each row tile). Pair p is token p // k's j-th choice, j = p % k."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    padded_starts = torch.cumsum(tiles * block_m, 0) - tiles * block_m
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - starts[flat[order]]
    pairs = torch.full((int(tiles.sum()) * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs[padded_starts[flat[order]] + rank] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32), tiles)
    return pairs, tile_expert


def _grouped_gemm(x, w, pairs, tile_expert, num_pairs, x_row_div, weights, block_m):
    N, K = w.shape[1], w.shape[2]
    y = torch.empty((num_pairs, N), dtype=x.dtype, device=x.device)
    small = num_pairs <= 64
    block_n, block_k = (32, 128) if small else (64, 64)
    grid = (tile_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](y, x, w, pairs, tile_expert, weights if weights is not None else x, num_pairs, N, K,
                               y.stride(0), x.stride(0), w.stride(0), w.stride(1), X_ROW_DIV=x_row_div,
                               MUL_WEIGHT=weights is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2)
    return y


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """As tandem.workers.layers.moe.fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]."""
    if x.dim() != 2 or x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("x, w13 and w2 must have contiguous last dimensions (x 2-D)")
    if w13.shape[0] != w2.shape[0] or w13.shape[2] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    check_runnable(_grouped_gemm_kernel, x, "fused_moe")
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    block_m = 16 if num_tokens * top_k <= 64 * w13.shape[0] else 64
    pairs, tile_expert = group_by_expert(topk_ids, w13.shape[0], block_m)
    num_pairs = num_tokens * top_k
    gate_up = _grouped_gemm(x, w13, pairs, tile_expert, num_pairs, top_k, None, block_m)
    down = _grouped_gemm(silu_and_mul(gate_up), w2, pairs, tile_expert, num_pairs, 1,
                         topk_weights.reshape(-1).contiguous(), block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


__all__ = ["fused_moe", "group_by_expert"]
