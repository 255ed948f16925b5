"""RMSNorm and residual-add + RMSNorm, in Triton: one program per row, float32 accumulation.

Rounding follows HF's LlamaRMSNorm, so results match the torch reference bit for bit in spirit:
the residual sum is rounded to the activation dtype before it is normalised, the normalised value
is rounded to the activation dtype before the weight multiplies it, and the output takes the
activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable

_MAX_HIDDEN = 65536  # one row per program, held in registers


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    stride_out,
    stride_x,
    hidden,
    eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x_f32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x_f32 * x_f32, axis=0) / hidden + eps)
    normed = (x_f32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_x,
    stride_residual,
    hidden,
    eps,
    BLOCK_N: tl.constexpr,
):
    # Reads the whole row before writing it, so updating x and residual in place is safe.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
    summed_f32 = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(summed_f32 * summed_f32, axis=0) / hidden + eps)
    normed = (summed_f32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, (normed * weight).to(x.dtype), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as a [rows, hidden] view sharing its storage (needed for in-place writes)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as err:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows"
        ) from err


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    hidden = x.shape[-1] if x.dim() else 0
    if hidden == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}] to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the {_MAX_HIDDEN} this kernel holds in one program")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    block_n = triton.next_power_of_2(hidden)
    return block_n, min(max(block_n // 512, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension; returns a new tensor in x's dtype."""
    block_n, num_warps = _check(x, weight)
    check_runnable(_rms_norm_kernel, x, "rms_norm")
    x_rows = _rows(x, "x")
    out = torch.empty_like(x_rows)
    if x_rows.shape[0]:
        _rms_norm_kernel[(x_rows.shape[0],)](
            out, x_rows, weight, out.stride(0), x_rows.stride(0), x_rows.shape[1], eps,
            BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), computed IN PLACE: x's buffer receives the normed
    output and residual's buffer the new residual; the two returned tensors are x and residual."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x and residual must share shape and dtype, got {tuple(x.shape)} {x.dtype} and "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    if x.device != residual.device:
        raise ValueError(f"x is on {x.device} but residual on {residual.device}")
    block_n, num_warps = _check(x, weight)
    check_runnable(_fused_add_rms_norm_kernel, x, "fused_add_rms_norm")
    x_rows, residual_rows = _rows(x, "x"), _rows(residual, "residual")
    if x_rows.shape[0]:
        _fused_add_rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, residual_rows, weight, x_rows.stride(0), residual_rows.stride(0), x_rows.shape[1], eps,
            BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    return x, residual


__all__ = ["rms_norm", "fused_add_rms_norm"]
