"""The fused MoE Triton kernel against the torch reference (tandem.workers.layers.moe), and the routing.

Tolerances: float32 atol = rtol = 1e-4 (the kernel sums each token's experts in another order); bfloat16 on GPU
atol = rtol = 3e-2.
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels.fused_moe import fused_moe, group_by_expert
from tandem.workers.layers import moe as reference


def _problem(tokens, hidden, inter, experts, top_k, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    weights, ids = reference.select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    return [t.to(device) if t.dtype == torch.int64 else t.to(device, dtype) for t in (x, w13, w2, weights, ids)]


def test_group_by_expert_pads_each_experts_run_to_a_tile():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    pairs, tile_expert = group_by_expert(ids, num_experts=4, block_m=2)
    assert tile_expert.tolist() == [0, 2, 2, 3]  # expert 1 has no pairs, expert 2 three (two tiles)
    assert pairs.tolist() == [1, 4, 0, 2, 5, 6, 3, 6]  # 6 = num_pairs: padding


@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k", [(1, 32, 16, 4, 2), (7, 48, 40, 8, 2),
                                                                    (20, 64, 32, 6, 3)])
def test_matches_reference(device, tokens, hidden, inter, experts, top_k):
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, experts, top_k, device)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_routing_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    for norm in (False, True):
        config = transformers.Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        router = Qwen2MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(5, 16)
        _, ref_weights, ref_ids = router(x)
        weights, ids = reference.select_experts(x @ router.weight.T, 3, renormalize=norm)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_mixtral_sized_gpu(device, dtype, tokens):
    x, w13, w2, weights, ids = _problem(tokens, 4096, 14336, 8, 2, device, dtype)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids),
                               atol=3e-2 if dtype == torch.bfloat16 else 1e-3, rtol=3e-2)
