"""Rotary position embedding (neox / HF rotate_half layout), applied in place by Triton.

For each token, dimension i < D/2 pairs with i + D/2:
    x[i]       <- x[i] * cos - x[i + D/2] * sin
    x[i + D/2] <- x[i + D/2] * cos + x[i] * sin
with cos/sin read from the row `position` of cos_sin_cache [max_positions, D] (first half cos, second
half sin, float32, any rope scaling already baked in). Arithmetic is float32, rounded once on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    stride_d,
    num_heads,
    cos,
    sin,
    HALF,
    HEADS_PADDED: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HALF_PADDED)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first_ptr = base_ptr + heads * stride_h + dims * stride_d
    second_ptr = first_ptr + HALF * stride_d
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(second_ptr, mask=mask, other=0.0)
    first_f32 = first.to(tl.float32)
    second_f32 = second.to(tl.float32)
    tl.store(first_ptr, (first_f32 * cos - second_f32 * sin).to(first.dtype), mask=mask)
    tl.store(second_ptr, (second_f32 * cos + first_f32 * sin).to(first.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)[None, :]
    row_ptr = cos_sin_ptr + position * stride_cache
    cos = tl.load(row_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        stride_qh,
        stride_qd,
        NUM_Q_HEADS,
        cos,
        sin,
        HALF,
        Q_HEADS_PADDED,
        HALF_PADDED,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        stride_kh,
        stride_kd,
        NUM_KV_HEADS,
        cos,
        sin,
        HALF,
        KV_HEADS_PADDED,
        HALF_PADDED,
    )


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] IN PLACE by positions [T]; returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv projection). Positions must index rows of
    cos_sin_cache; that bound is not checked on the device.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens or head_dim")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be [max_positions, {head_dim}] with contiguous rows, got "
            f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if len({positions.device, q.device, k.device, cos_sin_cache.device}) != 1:
        raise ValueError("positions, q, k and cos_sin_cache must be on one device")
    check_runnable(_rope_kernel, q, "apply_rotary")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        *q.stride(),
        *k.stride(),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=k.shape[1],
        HALF=half,
        Q_HEADS_PADDED=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PADDED=triton.next_power_of_2(k.shape[1]),
        HALF_PADDED=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q, k


__all__ = ["apply_rotary"]
