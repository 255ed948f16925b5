"""FP8 (e4m3) linear layers: weights stored in FP8 with one scale per output channel, multiplied three ways.

- On a GPU with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper), the activations are quantized per
  token (row) as each GEMM runs, and torch._scaled_mm multiplies the two FP8 operands, scaling each output by its
  row's and its column's scale (W8A8, dynamic activation scales, as vLLM's `--quantization fp8`).
- On other GPUs, a Triton GEMM widens each FP8 weight tile to the activations' dtype (W8A16); on any GPU it also
  serves GEMMs of at most WEIGHT_ONLY_MAX_ROWS rows, where no activation is quantized.
- On the CPU, the W8A8 arithmetic in torch: the reference the tests hold the GPU paths to.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # a row of zeros gets this scale, not 0 (which would divide by zero)
# GEMMs of at most this many rows use the weight-only Triton GEMM even where _scaled_mm runs (decode steps, whose
# time is reading the weights): _scaled_mm reads a decode step's weights at a far smaller share of the copy bandwidth
# than the Triton GEMM does (benchmarks/fp8_gemm_gpu.py; docs/benchmarks.md, "FP8 weights on the H200").
WEIGHT_ONLY_MAX_ROWS = 16


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] FP8, scales [M, 1] float32) with x ~= q * scales, each row scaled so that its largest
    magnitude maps to FP8_MAX (tandem.workers.kernels.fp8.quantize_rows is the GPU's)."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (FP8 weight [N, K], float32 scales [N]): each output channel scaled so that its largest
    magnitude maps to the largest FP8 value."""
    q, scales = quantize_rows_reference(weight)
    return q, scales.view(-1)


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs on `device`: a CUDA GPU of compute capability 8.9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] FP8 x scales [N]).T (+ bias) -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if x.device.type != "cuda":
        out = _reference(rows, weight, scales, bias)
    elif scaled_mm_supported(x.device) and rows.shape[0] > WEIGHT_ONLY_MAX_ROWS:
        out = _scaled(rows, weight, scales, bias)
    else:
        from tandem.workers.kernels.fp8 import fp8_weight_gemm

        out = fp8_weight_gemm(rows, weight, scales, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _scaled(rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    from tandem.workers.kernels.fp8 import quantize_rows

    q, row_scales = quantize_rows(rows)
    # Row-wise scaling takes bfloat16 out; the weight [N, K] row-major is the column-major [K, N] it wants.
    out = torch._scaled_mm(q, weight.t(), scale_a=row_scales, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out if rows.dtype == torch.bfloat16 else out.to(rows.dtype)


def _reference(rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """The W8A8 arithmetic in float32: FP8 products are exact there, and summed in float32 as on the GPU."""
    q, row_scales = quantize_rows_reference(rows)
    out = F.linear(q.float(), weight.float()) * row_scales * scales
    if bias is not None:
        out = out + bias.float()
    return out.to(rows.dtype)


__all__ = ["FP8", "FP8_MAX", "WEIGHT_ONLY_MAX_ROWS", "fp8_linear", "quantize_rows_reference", "quantize_weight",
           "scaled_mm_supported"]
