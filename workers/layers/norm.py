"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's LlamaRMSNorm (normalise in float32, cast back, then scale) so that
    # greedy outputs match transformers bit for bit in float32 and as closely as possible in bf16.
    # The in-place steps only touch fresh intermediates (and a * b == b * a exactly); the dtype checks skip
    # no-op casts, which still cost a dispatch each in the per-layer hot path.
    is_float32 = x.dtype == torch.float32
    x32 = x if is_float32 else x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * variance.add_(eps).rsqrt_()
    if not is_float32:
        normed = normed.to(x.dtype)
    return normed.mul_(weight) if weight.dtype == normed.dtype else weight * normed


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
