"""FP8 KV cache (--kv-cache-dtype fp8) in the Triton kernels and the CPU attention, against the torch reference.

Writes must be bit-exact (both sides round x / scale to nearest even e4m3). Reads are checked against float64
attention over the dequantized cache, at the float32 tolerances of test_paged_attention.py: dequantizing is exact
arithmetic on e4m3 values, so FP8 storage adds no error of its own to a read.
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import cpu_attention
from tandem.workers.kernels.cache_write import write_kv_cache
from tandem.workers.kernels.paged_attention import paged_attention
from tandem.workers.layers import attention as reference
from tandem.workers.layers import kv_quant

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


def fp8_batch(paged_batch, case, k_scale, v_scale, seed=0):
    """A paged batch whose cache holds keys / k_scale and values / v_scale in e4m3 (kv_cache stays float)."""
    query_lens, seq_lens, hq, hkv, d, bs = case
    batch = paged_batch(query_lens, seq_lens, hq, hkv, d, bs, seed=seed)
    cache = torch.empty_like(batch.kv_cache, dtype=kv_quant.FP8_KV)
    cache[:, :, 0] = kv_quant.quantize(batch.kv_cache[:, :, 0] * 3 * k_scale, k_scale)
    cache[:, :, 1] = kv_quant.quantize(batch.kv_cache[:, :, 1] * 3 * v_scale, v_scale)
    batch.fp8_cache = cache
    batch.k_fp8, batch.v_fp8 = cache[:, 1, 0], cache[:, 1, 1]
    return batch


def expected(batch, k_scale, v_scale):
    query = batch.query[: batch.num_tokens].double()
    keys = batch.k_fp8.double() * k_scale
    values = batch.v_fp8.double() * v_scale
    return reference.paged_attention(query, keys, values, batch.meta, batch.scale)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_quantizes_as_the_reference_does(device, scale, dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(6, 3, 2, 16, 2, 64).to(device, kv_quant.FP8_KV)
    key = (torch.randn(40, 2, 64, generator=gen) * 50).to(device, dtype)  # some past 448 * scale: clamped
    value = (torch.randn(40, 2, 64, generator=gen) * 1e-2).to(device, dtype)  # some in e4m3's subnormals
    key[0, 0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    slots = torch.randperm(96, generator=gen)[:40].to(device)
    slots[5] = -1  # padding: skipped
    want = cache.clone()
    keep = slots >= 0
    reference.write_kv_cache(key[keep], value[keep], want[:, 1, 0], want[:, 1, 1], slots[keep], scale, scale / 2)
    write_kv_cache(key, value, cache[:, 1, 0], cache[:, 1, 1], slots, k_scale=scale, v_scale=scale / 2)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert want.float().abs().max() == kv_quant.FP8_MAX  # the clamp was exercised


CASES = {
    "decode_g4_d64_bs16": ([1, 1, 1, 1], [1, 16, 17, 32], 8, 2, 64, 16),
    "mixed_g3_d64_bs16": ([1, 13, 1], [50, 30, 17], 9, 3, 64, 16),
    "mixed_g2_d80_bs16": ([1, 4], [20, 4], 4, 2, 80, 16),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.2)])
def test_triton_attention_reads_an_fp8_cache(paged_batch, case, scales):
    batch = fp8_batch(paged_batch, CASES[case], *scales, seed=list(CASES).index(case))
    out = paged_attention(batch.query, batch.k_fp8, batch.v_fp8, batch.meta, batch.scale,
                          k_scale=scales[0], v_scale=scales[1])
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out[: batch.num_tokens].double(), expected(batch, *scales), **FP32_TOL)


def test_split_kv_applies_the_value_scale_to_each_split(paged_batch):
    batch = fp8_batch(paged_batch, ([1, 1], [300, 129], 4, 2, 64, 16), 0.1, 0.3, seed=7)
    out = paged_attention(batch.query, batch.k_fp8, batch.v_fp8, batch.meta, batch.scale, num_splits=4,
                          k_scale=0.1, v_scale=0.3)
    torch.testing.assert_close(out[: batch.num_tokens].double(), expected(batch, 0.1, 0.3), **FP32_TOL)


@pytest.mark.parametrize("path", ["torch", "cpu"])
def test_the_cpu_paths_read_an_fp8_cache(paged_batch, path):
    """The torch reference dequantizes what it gathers; the native CPU kernel reads float caches only, so an FP8
    cache takes the torch path there (no extension needed)."""
    if torch.cuda.is_available():
        pytest.skip("CPU paths")
    batch = fp8_batch(paged_batch, CASES["mixed_g3_d64_bs16"], 0.05, 0.2, seed=2)
    attend = reference.paged_attention if path == "torch" else cpu_attention.paged_attention
    out = attend(batch.query, batch.k_fp8, batch.v_fp8, batch.meta, batch.scale, k_scale=0.05, v_scale=0.2)
    torch.testing.assert_close(out.double(), expected(batch, 0.05, 0.2), **FP32_TOL)


def test_the_reference_with_softcap_reads_an_fp8_cache(paged_batch):
    batch = fp8_batch(paged_batch, CASES["mixed_g2_d80_bs16"], 0.5, 0.5, seed=4)
    out = reference.paged_attention(batch.query, batch.k_fp8, batch.v_fp8, batch.meta, batch.scale, 30.0, 8,
                                    k_scale=0.5, v_scale=0.5)
    keys, values = batch.k_fp8.float() * 0.5, batch.v_fp8.float() * 0.5
    want = reference.paged_attention(batch.query, keys, values, batch.meta, batch.scale, 30.0, 8)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_a_float_cache_of_another_dtype_is_still_refused(paged_batch):
    batch = paged_batch([1], [5], 2, 2, 64, 16)
    with pytest.raises(ValueError, match="differs from query dtype"):
        paged_attention(batch.query.double(), batch.k_cache, batch.v_cache, batch.meta, batch.scale)
