"""FP8 (e4m3) GEMM pieces in Triton: activations quantized per token (row), and a GEMM of FP8 weights with
per-output-channel scales whose weight tiles are widened to the activations' dtype on the fly (for GPUs without
FP8 tensor cores, and for the few rows of a decode step, where reading the weights is the cost).

The torch references (tandem.workers.layers.fp8_linear) do the same arithmetic on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.kernels._launch import check_runnable
from tandem.workers.layers.fp8_linear import FP8, FP8_MAX, MIN_SCALE

_QUANT_BLOCK = 1024
_GEMM_BLOCK_N, _GEMM_BLOCK_K = 64, 128


@triton.jit
def _quantize_rows_kernel(q_ptr, scale_ptr, x_ptr, stride_q, stride_x, K, FP8_MAX: tl.constexpr,
                          MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales [M, 1] float32) with x ~= q * scales, each row scaled so that
    its largest magnitude maps to 448."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dimension, got shape {tuple(x.shape)}")
    check_runnable(_quantize_rows_kernel, x, "quantize_rows")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _quantize_rows_kernel[(x.shape[0],)](q, scales, x, q.stride(0), x.stride(0), x.shape[1], FP8_MAX=FP8_MAX,
                                             MIN_SCALE=MIN_SCALE, BLOCK=_QUANT_BLOCK, num_warps=4)
    return q, scales


@triton.jit
def _fp8_weight_gemm_kernel(y_ptr, x_ptr, w_ptr, scale_ptr, bias_ptr, M, N, K, stride_y, stride_x, stride_w,
                            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        # The weight is [N, K] row-major: a [BLOCK_K, BLOCK_N] tile of its transpose, widened to x's dtype.
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:  # float32 activations: a float32 product, not TF32's
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8_e4m3fn x scales [N]).T (+ bias) -> [M, N] in x's dtype, accumulated in
    float32. `config`: launch parameters (BLOCK_N, BLOCK_K, num_warps, num_stages) over the defaults for M rows
    (benchmarks/fp8_gemm_gpu.py times the choices)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be 2-D with contiguous last dimensions")
    if weight.dtype != FP8 or x.shape[1] != weight.shape[1] or scales.shape != (weight.shape[0],):
        raise ValueError(f"expected a float8_e4m3fn weight [N, {x.shape[1]}] and scales [N], got "
                         f"{weight.dtype} {tuple(weight.shape)} and {tuple(scales.shape)}")
    check_runnable(_fp8_weight_gemm_kernel, x, "fp8_weight_gemm")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        small = M <= 16  # a decode step: reading the weight is the cost, so more, narrower column tiles
        launch = {"BLOCK_M": 16 if small else 64, "BLOCK_N": 32 if small else _GEMM_BLOCK_N,
                  "BLOCK_K": 512 if small else _GEMM_BLOCK_K, "num_warps": 4, "num_stages": 3, **(config or {})}
        grid = (triton.cdiv(M, launch["BLOCK_M"]), triton.cdiv(N, launch["BLOCK_N"]))
        _fp8_weight_gemm_kernel[grid](y, x, weight, scales, bias if bias is not None else scales, M, N, K,
                                      y.stride(0), x.stride(0), weight.stride(0), HAS_BIAS=bias is not None,
                                      IEEE=x.dtype == torch.float32, **launch)
    return y


__all__ = ["FP8", "FP8_MAX", "fp8_weight_gemm", "quantize_rows"]
