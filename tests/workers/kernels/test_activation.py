"""Triton SiLU-and-mul against the torch reference (tandem.workers.layers.activation).

Tolerances: float32 atol = rtol = 1e-5 (exp implementations differ); bfloat16 on GPU one bf16 step
(atol = rtol = 1.6e-2), as both round silu to bf16 before the product.
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.activation import silu_and_mul
from tandem.workers.layers import activation as reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 1536), (2, 3, 2 * 100)])
def test_matches_reference(device, shape):
    # 1536 spans two 1024-column programs, the second one partial.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).mul(4).to(device)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **TOL[torch.float32])


def test_strided_rows(device):
    buffer = torch.randn(4, 300, device=device)
    x = buffer[:, :256]
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **TOL[torch.float32])


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("intermediate", [1536, 14336])
def test_full_size_gpu(device, dtype, intermediate):
    x = torch.randn(4096, 2 * intermediate, device=device).mul(4).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])
