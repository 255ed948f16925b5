"""FP8 pieces against their float references: per-token quantization, and the GEMM of FP8 weights.

Quantizing rounds to e4m3 (3 mantissa bits): the kernel and the torch reference must agree exactly on the scales
and on every FP8 value (both divide the same float32 values by the same scale). The GEMM accumulates in float32:
float32 activations in the interpreter agree with the float reference to float32 rounding (rtol 1e-5 of the
row's scale)."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.fp8 import FP8, FP8_MAX, fp8_weight_gemm, quantize_rows
from tandem.workers.layers.fp8_linear import quantize_rows_reference


@pytest.mark.parametrize("shape", [(1, 64), (5, 1500), (3, 2048 + 7)])
def test_quantize_rows_matches_the_reference_exactly(device, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])).mul(3).to(device)
    x[0, :7] = 0.0
    if shape[0] > 2:
        x[2] = 0.0  # a row of zeros gets the smallest scale, and zeros
    q, scales = quantize_rows(x)
    ref_q, ref_scales = quantize_rows_reference(x)
    assert q.dtype == FP8 and scales.shape == (shape[0], 1)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    compared = torch.ones_like(ref_q, dtype=torch.bool)
    if device.type == "cpu":
        # Triton 3.9's interpreter does not carry a rounding up into the exponent when it converts to FP8
        # (127.9 becomes 64, not 128; the GPU rounds as torch does): those values are left out there.
        ref = ref_q.float().abs()
        compared = ~((ref == torch.exp2(torch.log2(ref).round())) & ((x.float() / ref_scales).abs() < ref))
    assert torch.equal(q.view(torch.uint8)[compared], ref_q.view(torch.uint8)[compared])
    assert compared.float().mean() > 0.95
    # Each row's largest magnitude lands on the largest FP8 value; the rest within e4m3's rounding (1/16).
    assert torch.equal(ref_q.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0].cpu(),
                       torch.full(((x.abs().amax(dim=1) > 0).sum().item(),), FP8_MAX))
    torch.testing.assert_close((ref_q.float() * ref_scales), x.float(), rtol=1 / 16, atol=float(scales.max()) / 2)


def quantized_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scales = quantize_rows_reference(w)
    return q, scales.view(-1)


@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (3, 130, 200), (17, 64, 384), (70, 96, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_weight_gemm_matches_the_float_reference(device, m, n, k, bias):
    q, scales = quantized_weight(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    b = torch.randn(n) if bias else None
    expected = x @ (q.float() * scales[:, None]).T + (b if bias else 0)
    out = fp8_weight_gemm(x.to(device), q.to(device), scales.to(device), None if b is None else b.to(device))
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)


def test_fp8_weight_gemm_refuses_what_it_cannot_run(device):
    q, scales = quantized_weight(64, 128, seed=0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_gemm(torch.randn(2, 128, device=device), q.float().to(device), scales.to(device))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_gemm(torch.randn(2, 64, device=device), q.to(device), scales.to(device))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_fp8_weight_gemm_bf16_full_size(m):
    q, scales = quantized_weight(4096, 4096, seed=m)
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    expected = x.float() @ (q.float() * scales[:, None]).T.cuda()
    out = fp8_weight_gemm(x, q.cuda(), scales.cuda())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
