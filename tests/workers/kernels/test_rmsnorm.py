"""Triton RMSNorm against the torch reference (tandem.workers.layers.norm).

Tolerances: float32 atol = rtol = 1e-5 (rsqrt and summation order differ). bfloat16 on GPU: both sides
round to bf16 at the same two points, but a float32 difference in the last place can flip either
rounding, so two bf16 steps (atol = rtol = 1.6e-2); the residual sum is one correctly rounded add on both
sides and must match exactly in float32, to within one bf16 step in bf16.
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tandem.workers.layers import norm as reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
RESIDUAL_TOL = {torch.float32: dict(atol=0, rtol=0), torch.bfloat16: dict(atol=0, rtol=2**-8)}


def inputs(device, shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(shape, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 100)])
def test_rms_norm(device, shape):
    x, _, weight = inputs(device, shape, torch.float32)
    original = x.clone()
    out = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(original, weight, 1e-5), **TOL[torch.float32])
    assert torch.equal(x, original)  # the plain variant does not write its input


@pytest.mark.parametrize("shape", [(1, 64), (9, 576), (2, 3, 100)])
def test_fused_add_rms_norm_in_place(device, shape):
    x, residual, weight = inputs(device, shape, torch.float32, seed=1)
    expected_normed, expected_residual = reference.fused_add_rms_norm(
        x.clone(), residual.clone(), weight, 1e-6
    )
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    # Documented in-place contract: the outputs are the input buffers.
    assert normed.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(normed, expected_normed, **TOL[torch.float32])
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)


def test_strided_rows(device):
    # Rows that are slices of a wider buffer: the kernel must use the row stride, not the hidden size.
    buffer = torch.randn(6, 160, device=device)
    x = buffer[:, :128]
    weight = torch.rand(128, device=device)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOL[torch.float32]
    )


def test_rejects_bad_inputs(device):
    x, residual, weight = inputs(device, (2, 64), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="share shape"):
        fused_add_rms_norm(x, residual[:1], weight, 1e-5)
    with pytest.raises(ValueError, match="contiguous last"):
        rms_norm(x.t(), weight[:2], 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_full_size_gpu(device, dtype, hidden):
    x, residual, weight = inputs(device, (4096, hidden), dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOL[dtype])
    expected_normed, expected_residual = reference.fused_add_rms_norm(
        x.clone(), residual.clone(), weight, 1e-5
    )
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(normed, expected_normed, **TOL[dtype])
    torch.testing.assert_close(new_residual, expected_residual, **RESIDUAL_TOL[dtype])
