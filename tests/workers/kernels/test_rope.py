"""Triton rotary embedding against the torch reference (tandem.workers.layers.rotary).

Tolerances: float32 atol = rtol = 1e-5. The reference rotates bf16 tensors in bf16 (cos/sin rounded
first, each product rounded); the kernel computes in float32 and rounds once, so bf16 on GPU allows a
few bf16 steps on values of size ~4: atol = 3e-2, rtol = 1.6e-2.
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.rope import apply_rotary
from tandem.workers.layers import rotary as reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2)}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def check(
    device, num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, rope_scaling=None, max_pos=2048, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    cache = reference.compute_cos_sin_cache(head_dim, max_pos, 500000.0, rope_scaling).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
    # q and k as the model has them: strided slices of one fused qkv projection output.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(
        device, dtype
    )
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    expected_q, expected_k = reference.apply_rotary(positions, q.clone(), k.clone(), cache)
    out_q, out_k = apply_rotary(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize(
    "num_tokens,num_q_heads,num_kv_heads,head_dim,scaling",
    [(1, 1, 1, 64, None), (9, 9, 3, 64, None), (5, 8, 2, 128, LLAMA3_SCALING), (4, 4, 4, 96, None)],
)
def test_matches_reference(device, num_tokens, num_q_heads, num_kv_heads, head_dim, scaling):
    check(device, num_tokens, num_q_heads, num_kv_heads, head_dim, torch.float32, scaling, seed=num_tokens)


def test_position_zero_is_identity(device):
    cache = reference.compute_cos_sin_cache(64, 16, 10000.0).to(device)
    q, k = torch.randn(3, 2, 64, device=device), torch.randn(3, 1, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    apply_rotary(torch.zeros(3, dtype=torch.int64, device=device), q, k, cache)
    torch.testing.assert_close(q, q0, atol=0, rtol=0)
    torch.testing.assert_close(k, k0, atol=0, rtol=0)


def test_rejects_bad_inputs(device):
    cache = reference.compute_cos_sin_cache(64, 16, 10000.0).to(device)
    q, k = torch.randn(3, 2, 64, device=device), torch.randn(3, 1, 64, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(torch.zeros(3, dtype=torch.int64, device=device), q[..., :32], k[..., :32], cache)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(torch.zeros(2, dtype=torch.int64, device=device), q, k, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(64, 9, 3), (128, 32, 8)])
def test_full_size_gpu(device, dtype, head_dim, num_q_heads, num_kv_heads):
    check(device, 4096, num_q_heads, num_kv_heads, head_dim, dtype, LLAMA3_SCALING, max_pos=131072)
