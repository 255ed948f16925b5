"""The CPU fast paths of the torch reference ops and the model: pre-packed oneDNN GEMM weights, the per-step
plan paged attention caches on its metadata (also with decodes split into length buckets), bf16 attention,
the one-entry step memo, and rotary/norm staying bit-identical to transformers' formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.workers.layers import attention, norm, rotary
from tandem.workers.layers.memo import StepMemo
from tandem.workers.models import llama

BLOCK, HQ, HKV, D, NUM_LAYERS, NUM_BLOCKS = 4, 6, 2, 8, 3, 48

requires_onednn = pytest.mark.skipif(not llama._ONEDNN, reason="oneDNN is not available in this torch build")


# -- packed GEMM weights ---------------------------------------------------------------------------------


@requires_onednn
@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_packed_linear_matches_f_linear_in_float32(rows):
    weight, bias = torch.randn(40, 24), torch.randn(40)
    layer = llama.Linear(24, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = torch.randn(rows, 24)
    out = layer(x)
    expected = F.linear(x, weight, bias)
    if rows < llama._MIN_PACKED_F32_ROWS:
        assert torch.equal(out, expected)  # the same MKL call as transformers: bit for bit
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not llama._ONEDNN_BF16, reason="no oneDNN bf16 support on this CPU")
def test_packed_linear_matches_f_linear_in_bfloat16():
    layer = llama.Linear(64, 48).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight).float(), rtol=1e-2, atol=1e-2)


@requires_onednn
def test_packed_weight_is_rebuilt_when_the_weight_is_written():
    layer = llama.Linear(16, 8)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16))
    x = torch.randn(llama._MIN_PACKED_F32_ROWS, 16)
    first = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), 2 * first, rtol=1e-5, atol=1e-5)


# -- paged attention: per-step plan, GEMM and flash paths, bf16 -------------------------------------------


def _dense_reference(query, keys, values, seq_len, scale):
    group = HQ // HKV
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    query_pos = torch.arange(seq_len - query.shape[0], seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _check_all_layers(query_lens, seq_lens, attention_metadata, dtype=torch.float32, atol=1e-5, seed=0):
    """Every layer of one step runs with the same metadata object (so layers after the first use the cached
    plan) on its own cache slice, and must match the dense reference of its own keys."""
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK, HKV, D, dtype=dtype)
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [[order.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    _, meta = attention_metadata(query_lens, seq_lens, tables, BLOCK)
    total = sum(query_lens)
    for layer in range(NUM_LAYERS):
        k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
        full_keys = [torch.randn(s, HKV, D, generator=generator).to(dtype) for s in seq_lens]
        full_values = [torch.randn(s, HKV, D, generator=generator).to(dtype) for s in seq_lens]
        for table, keys, values, seq_len, query_len in zip(tables, full_keys, full_values, seq_lens, query_lens):
            for pos in range(seq_len - query_len):
                k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
                v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        new_keys = torch.cat([k[s - q :] for k, s, q in zip(full_keys, seq_lens, query_lens)])
        new_values = torch.cat([v[s - q :] for v, s, q in zip(full_values, seq_lens, query_lens)])
        attention.write_kv_cache(new_keys, new_values, k_cache, v_cache, meta.slot_mapping)
        query = torch.randn(total, HQ, D, generator=generator).to(dtype)
        out = attention.paged_attention(query, k_cache, v_cache, meta, scale=D**-0.5)
        assert out.dtype == dtype
        start, expected = 0, []
        for keys, values, seq_len, query_len in zip(full_keys, full_values, seq_lens, query_lens):
            expected.append(_dense_reference(query[start : start + query_len], keys, values, seq_len, D**-0.5))
            start += query_len
        torch.testing.assert_close(out.double(), torch.cat(expected), rtol=0, atol=atol)


CASES = [([1], [9]), ([1, 1, 1, 1], [1, 5, 17, 12]), ([6], [6]), ([5, 1, 3, 1, 4], [5, 7, 11, 16, 4])]
CASE_IDS = ["decode1", "decode_batch", "prefill", "mixed"]


@pytest.mark.parametrize("query_lens, seq_lens", CASES, ids=CASE_IDS)
def test_every_layer_of_a_step_uses_the_cached_plan_correctly(attention_metadata, query_lens, seq_lens):
    _check_all_layers(query_lens, seq_lens, attention_metadata)


@pytest.mark.parametrize("query_lens, seq_lens", CASES, ids=CASE_IDS)
def test_decodes_split_into_length_groups(attention_metadata, monkeypatch, query_lens, seq_lens):
    monkeypatch.setattr(attention, "_GROUP_COST_TOKENS", 0)  # a group per distinct padded length
    _check_all_layers(query_lens, seq_lens, attention_metadata)


def test_length_groups_trade_padding_against_group_count():
    lengths = [4000, 16, 3990, 9, 16, 4001]
    groups = attention._length_groups(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [sorted(g) for g in groups] == [[0, 2, 5], [1, 3, 4]]  # long ones apart from short ones
    assert attention._length_groups([100, 90, 80], 16) == [[0, 1, 2]]  # not worth a second group
    assert attention._length_groups([7], 16) == [[0]]


@pytest.mark.parametrize("query_lens, seq_lens", CASES, ids=CASE_IDS)
def test_bfloat16_paged_attention(attention_metadata, query_lens, seq_lens):
    # The reference sees the same bf16-rounded inputs; what is left is bf16 rounding inside the kernel.
    _check_all_layers(query_lens, seq_lens, attention_metadata, dtype=torch.bfloat16, atol=3e-2)


# -- step memo -------------------------------------------------------------------------------------------


def test_step_memo_reuses_only_for_the_same_tensors_and_equal_values():
    memo, calls = StepMemo(), []
    a, b = torch.arange(3), torch.arange(3)

    def compute(tag):
        calls.append(tag)
        return tag

    assert memo.get((a, 16), lambda: compute("a16")) == "a16"
    assert memo.get((a, 16), lambda: compute("again")) == "a16"
    assert memo.get((b, 16), lambda: compute("b16")) == "b16"  # equal values, different tensor: recomputed
    assert memo.get((b, 300), lambda: compute("b300")) == "b300"
    assert memo.get((b, 300), lambda: compute("again")) == "b300"  # equal non-interned ints hit
    assert calls == ["a16", "b16", "b300"]


# -- bit-identity with transformers' formulas ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_is_bit_identical_to_rotate_half(dtype):
    cache = rotary.compute_cos_sin_cache(16, 64, 10000.0)
    positions = torch.tensor([0, 5, 17, 63])
    q, k = torch.randn(4, 6, 16, dtype=dtype), torch.randn(4, 2, 16, dtype=dtype)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), -1).to(dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), -1).to(dtype).unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    q_out, k_out = rotary.apply_rotary(positions, q, k, cache)
    assert torch.equal(q_out, q * cos + rotate_half(q) * sin)
    assert torch.equal(k_out, k * cos + rotate_half(k) * sin)


def test_rms_norm_with_a_float32_weight_on_bf16_input_promotes_like_transformers():
    x, weight = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(32)
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out = norm.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
