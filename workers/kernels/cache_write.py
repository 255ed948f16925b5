"""Scatter the new tokens' keys and values into the paged KV cache, in Triton.

One program per token copies all KV heads of its key and value to the token's slot
(slot = block * block_size + offset). Negative slots mark padding tokens and are skipped, so a
batch padded for a CUDA graph needs no host-side filtering. An FP8 cache stores x / scale, clamped to e4m3's
range (kv_quant.quantize's arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable
from tandem.workers.layers.kv_quant import FP8_MAX, is_fp8

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _to_e4m3_grid(x):
    """float32 x (|x| <= 448) rounded to nearest even e4m3 value, in float32, so that the cast after it is exact.

    Done by hand because Triton's interpreter rounds float32 -> fp8 wrongly (no carry into the exponent); on a GPU
    the cast alone would round the same. Adding 1.5 * 2^(e + 20) rounds at e4m3's spacing 2^(e - 3) for x in
    [2^e, 2^(e+1)), and at 2^-9 below 2^-6 (its subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 121)  # 121 = 127 - 6: the subnormals' fixed spacing
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (x + magic) - magic
    return tl.where(rounded == 0.0, x * 0.0, rounded)  # keeps -0's sign, as torch's cast does


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    if KV_FP8:
        key = _to_e4m3_grid(tl.minimum(tl.maximum(key.to(tl.float32) / k_scale, -_FP8_MAX), _FP8_MAX))
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    if KV_FP8:
        value = _to_e4m3_grid(tl.minimum(tl.maximum(value.to(tl.float32) / v_scale, -_FP8_MAX), _FP8_MAX))
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] in place.

    The caches may be strided views (kv_cache[:, layer, 0]); slots < 0 are skipped. Slots past the
    cache are not checked on the device (that would need a sync): the block manager owns that bound.
    An FP8 cache stores key / k_scale and value / v_scale.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [tokens, kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if len({key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}) != 1:
        raise ValueError("key, value, caches and slot_mapping must be on one device")
    check_runnable(_write_kv_cache_kernel, key, "write_kv_cache")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_padded = triton.next_power_of_2(num_heads)
    head_dim_padded = triton.next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PADDED=heads_padded,
        HEAD_DIM_PADDED=head_dim_padded,
        KV_FP8=is_fp8(k_cache),
        num_warps=4 if heads_padded * head_dim_padded >= 1024 else 1,
    )


__all__ = ["write_kv_cache"]
