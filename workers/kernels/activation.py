"""SiLU-and-multiply for gated MLPs, in Triton: out = silu(x[:, :I]) * x[:, I:].

Rounded like torch's eager bf16/fp16 path (silu rounded to the activation dtype, then the product),
computed in float32 in between.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_out, stride_x, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    gate_f32 = gate.to(tl.float32)
    silu = (gate_f32 / (1.0 + tl.exp(-gate_f32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (first half gate, second half up) -> [..., I] in x's dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must end in an even dimension (gate | up), got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    check_runnable(_silu_and_mul_kernel, x, "silu_and_mul")
    inner = x.shape[-1] // 2
    x_rows = x.reshape(-1, x.shape[-1])
    out = torch.empty((x_rows.shape[0], inner), dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (x_rows.shape[0], triton.cdiv(inner, _BLOCK))
        _silu_and_mul_kernel[grid](
            out, x_rows, out.stride(0), x_rows.stride(0), inner, BLOCK=_BLOCK, num_warps=4
        )
    return out.view(*x.shape[:-1], inner)


__all__ = ["silu_and_mul"]
