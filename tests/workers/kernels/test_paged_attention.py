"""Triton paged attention against the torch reference (tandem.workers.layers.attention.paged_attention).

The reference runs in float64 on the same (upcast) inputs, so the tolerances measure the kernel alone:
float32 (interpreter, and exact "ieee" dots on GPU) atol = rtol = 1e-4, observed ~1e-6; bfloat16 on GPU
atol = rtol = 2e-2 (the kernel rounds probabilities to bf16 before the P @ V dot, as flash attention does;
with the GPU's rounding emulated in the interpreter the largest error seen was ~0.1 of this tolerance).
"""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels import paged_attention as pa
from tandem.workers.kernels.paged_attention import choose_num_splits, compile_eager_builds, paged_attention
from tandem.workers.layers import attention as reference

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def check(batch, num_splits=None, tol=FP32_TOL):
    out = paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, num_splits=num_splits
    )
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    query = batch.query[: batch.num_tokens].double()
    expected = reference.paged_attention(
        query, batch.k_cache.double(), batch.v_cache.double(), batch.meta, batch.scale
    )
    torch.testing.assert_close(out[: batch.num_tokens].double(), expected, **tol)


# (query_lens, seq_lens, Hq, Hkv, head_dim, block_size): each batch covers several edge cases at once.
CASES = {
    # context length 1, exactly one block, one past a block, two blocks; GQA 4
    "decode_block_edges_g4_d64_bs16": ([1, 1, 1, 1], [1, 16, 17, 32], 8, 2, 64, 16),
    "decode_g1_d128_bs32": ([1, 1, 1], [31, 32, 33], 2, 2, 128, 32),
    "decode_g8_d64_bs64": ([1, 1], [64, 130], 16, 2, 64, 64),
    # fresh prefills (no cached prefix), one exactly a block long
    "prefill_g1_d64_bs16": ([16, 5], [16, 5], 2, 2, 64, 16),
    # prefill chunks over a cached prefix, mixed with decodes
    "mixed_g4_d128_bs16": ([1, 9, 1, 20], [40, 9, 65, 50], 8, 2, 128, 16),
    "mixed_g8_d64_bs32": ([3, 1, 17], [35, 70, 17], 16, 2, 64, 32),
    "mixed_g1_d128_bs64": ([1, 12], [129, 76], 1, 1, 128, 64),
    # SmolLM2-135M's shape: 9 query heads over 3 KV heads, a group that does not divide the tile rows
    "mixed_g3_d64_bs16": ([1, 13, 1], [50, 30, 17], 9, 3, 64, 16),
    # a head dim that is not a power of two (padded to 128 inside the kernel)
    "mixed_g2_d80_bs16": ([1, 4], [20, 4], 4, 2, 80, 16),
    # a chunk longer than one query tile (BLOCK_Q = 64 rows / 1 head) over a prefix
    "long_chunk_g1_d64_bs16": ([70], [90], 1, 1, 64, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(paged_batch, case):
    query_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    check(paged_batch(query_lens, seq_lens, hq, hkv, d, bs, seed=list(CASES).index(case)))


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize(
    "case", ["decode_block_edges_g4_d64_bs16", "mixed_g4_d128_bs16", "mixed_g3_d64_bs16"]
)
def test_split_kv_matches_reference(paged_batch, case, num_splits):
    # 5 splits of contexts that are often a single KV tile: most splits are empty and must merge as nothing.
    query_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    check(paged_batch(query_lens, seq_lens, hq, hkv, d, bs, seed=num_splits), num_splits=num_splits)


def test_split_kv_long_context(paged_batch):
    check(paged_batch([1, 1, 4], [300, 129, 200], 8, 2, 64, 16, seed=7), num_splits=3)


@pytest.mark.parametrize("query_lens", [[1, 6, 1], [1, 1, 1]])
def test_shared_prefix_blocks_and_padding_rows(paged_batch, query_lens):
    # Two sequences share their first two blocks (a prefix-cache hit); the query carries padding rows
    # (as a batch padded for a CUDA graph does) that the kernel must neither read as tokens nor trip over.
    batch = paged_batch(
        query_lens, [40, 38, 33], 8, 2, 64, 16, seed=3, shared_prefix_blocks=2, padding_tokens=5
    )
    assert batch.meta.block_tables[0, 0] == batch.meta.block_tables[1, 0]
    check(batch)


def test_strided_query_view(paged_batch):
    # The model hands over q as a slice of the fused qkv projection output.
    batch = paged_batch([1, 5], [20, 5], 4, 2, 64, 16, seed=11)
    qkv = torch.randn(batch.num_tokens, (4 + 2 + 2) * 64, device=batch.query.device)
    batch.query = qkv[:, : 4 * 64].view(batch.num_tokens, 4, 64)
    assert not batch.query.is_contiguous()
    check(batch)


@pytest.mark.parametrize("seed", range(3))
def test_random_batches(paged_batch, seed):
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    hkv, group, d, bs = pick([1, 2]), pick([1, 3, 4, 8]), pick([64, 128]), pick([16, 32, 64])
    query_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 4, (1,), generator=rng))):
        seq_len = int(torch.randint(1, 100, (1,), generator=rng))
        query_lens.append(pick([1, 1, seq_len, max(1, seq_len // 3)]))
        seq_lens.append(seq_len)
    batch = paged_batch(query_lens, seq_lens, hkv * group, hkv, d, bs, seed=seed)
    check(batch, num_splits=pick([None, 1, 3]))


def test_choose_num_splits(monkeypatch):
    monkeypatch.setattr(pa, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert choose_num_splits(64, 8, 4096, cuda) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 32768, cuda) == 32  # batch 1, long context: split to the cap
    assert choose_num_splits(2, 8, 4096, cuda) == 8  # limited by keeping >= 512 keys per split
    assert choose_num_splits(2, 8, 700, cuda) == 1  # too short to be worth a merge
    assert choose_num_splits(1, 8, 32768, torch.device("cpu")) == 1
    assert choose_num_splits(3, 8, 6000, cuda) == 16  # 11 by occupancy (264 / 24 programs), rounded up


def test_compile_eager_builds_launches_each_tile_kind_and_split_count(device):
    """What ModelRunner runs at start on a GPU (tests/workers/kernels/test_compile_for_hopper.py checks that it leaves
    nothing for eager steps to compile): decode and prefill tiles x split counts 1, 2, 4, 8, 16, 32."""
    kv_cache = torch.randn(3, 2, 2, 16, 2, 64, device=device)
    before = kv_cache.clone()
    assert compile_eager_builds(kv_cache[:, 1, 0], kv_cache[:, 1, 1], num_q_heads=4) == 12
    assert torch.equal(kv_cache, before)  # the launches read the cache, never write it


def test_split_counts_are_powers_of_two(monkeypatch):
    """Each split count is a kernel variant of its own: eager steps of changing batches must not compile one per
    count (up to 32), only one per power of two."""
    monkeypatch.setattr(pa, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    counts = {choose_num_splits(tiles, 8, length, cuda) for tiles in range(1, 40) for length in range(1, 40000, 97)}
    assert counts == {1, 2, 4, 8, 16, 32}


def test_rejects_bad_shapes(paged_batch):
    batch = paged_batch([1], [5], 3, 2, 64, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    batch = paged_batch([1], [5], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        paged_attention(batch.query[..., :32], batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(batch.query.double(), batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, num_splits=0)


# Full size on a GPU: Llama-3-8B attention (32 q heads, 8 KV heads, head dim 128).
GPU_CASES = {
    "decode_64": ([1] * 64, None),
    "mixed": ([1] * 30 + [512, 1000, 7], None),
    "prefill_over_prefix": ([2048], [3000]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_full_size_gpu(paged_batch, case, block_size, dtype):
    query_lens, seq_lens = GPU_CASES[case]
    rng = torch.Generator().manual_seed(block_size)
    if seq_lens is None:
        seq_lens = [q + int(torch.randint(0, 4096 - q, (1,), generator=rng)) for q in query_lens]
    batch = paged_batch(query_lens, seq_lens, 32, 8, 128, block_size, dtype=dtype, num_layers=4, layer=2)
    check(batch, tol=BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_split_kv_full_size_gpu(paged_batch, group, dtype):
    batch = paged_batch([1, 1], [8191, 16384], 8 * group, 8, 128, 16, dtype=dtype, num_layers=2, layer=1)
    assert choose_num_splits(2, 8, 16384, batch.query.device) > 1
    check(batch, tol=BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)
    check(batch, num_splits=16, tol=BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)
