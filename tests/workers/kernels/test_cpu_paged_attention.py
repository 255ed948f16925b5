"""The native CPU paged-attention kernel (tandem.workers.kernels.cpu_attention) against the torch reference.

The reference runs in float64 on the same (upcast) inputs, so the tolerances measure the kernel alone: it
keeps scores, softmax and the weighted sum in float32 (observed error ~1e-7 in float32) and rounds only
its output to bfloat16 / float16.

Where a C++ compiler is present (CI, a developer's machine) the kernel must build: a build failure fails
these tests rather than skipping them, since "auto" would silently serve with the slower torch path.
"""

from __future__ import annotations

import os

import pytest
import torch

from tandem.workers.kernels import cpu_attention, cpu_extension
from tandem.workers.layers import attention as reference
from tandem.workers.layers.ops import get_ops, resolve_backend

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


pytestmark = pytest.mark.usefixtures("cpu_extension_built")  # tests/workers/kernels/conftest.py


@pytest.fixture
def device() -> torch.device:
    """Overrides the kernels conftest's (CUDA when present): this kernel is CPU only."""
    return torch.device("cpu")


def check(batch, dtype=torch.float32):
    out = cpu_attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    expected = reference.paged_attention(
        batch.query.double(), batch.k_cache.double(), batch.v_cache.double(), batch.meta, batch.scale
    )
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


# (query_lens, seq_lens, Hq, Hkv, head_dim, block_size). Head sizes 64 and 128 take the compiled-in
# unrolled variants, others the generic one; 2+ sequences per thread make an item a whole sequence, fewer
# make it one KV head.
CASES = {
    "decode_block_edges_g4_d64_bs16": ([1, 1, 1, 1], [1, 16, 17, 32], 8, 2, 64, 16),
    "decode_single_g3_d64_bs16": ([1], [250], 9, 3, 64, 16),
    "decode_g1_d128_bs32": ([1, 1, 1], [31, 32, 33], 2, 2, 128, 32),
    "decode_g8_d64_bs8_many": ([1] * 9, [5, 70, 8, 9, 130, 1, 64, 33, 200], 16, 2, 64, 8),
    "decode_g2_d80_bs16": ([1, 1], [20, 47], 4, 2, 80, 16),
    "decode_g1_d32_bs4": ([1, 1, 1, 1, 1], [3, 4, 5, 40, 1], 2, 2, 32, 4),
    # decodes riding with prefill chunks (the chunks go to the reference path inside)
    "mixed_g3_d64_bs16": ([1, 13, 1], [50, 30, 17], 9, 3, 64, 16),
    "mixed_g4_d128_bs16": ([1, 9, 1, 20], [40, 9, 65, 50], 8, 2, 128, 16),
    "prefill_only_g1_d64_bs16": ([16, 5], [16, 5], 2, 2, 64, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(paged_batch, case, dtype):
    query_lens, seq_lens, hq, hkv, d, bs = CASES[case]
    check(paged_batch(query_lens, seq_lens, hq, hkv, d, bs, dtype=dtype, seed=list(CASES).index(case)), dtype)


def test_shared_prefix_blocks(paged_batch):
    """Sequences reading the same first blocks, as after a prefix-cache hit."""
    check(paged_batch([1, 1, 1, 1, 1], [40, 41, 64, 33, 90], 8, 2, 64, 16, shared_prefix_blocks=2, seed=3))


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(paged_batch, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    num_seqs = int(torch.randint(1, 12, (1,), generator=generator))
    seq_lens = torch.randint(1, 300, (num_seqs,), generator=generator).tolist()
    query_lens = [1 if torch.rand(1, generator=generator) < 0.7 else max(1, s // 3) for s in seq_lens]
    check(paged_batch(query_lens, seq_lens, 9, 3, 64, 16, seed=seed))


def test_large_values_do_not_overflow(paged_batch):
    """Scores in the thousands: the softmax subtracts the maximum before exponentiating."""
    batch = paged_batch([1, 1], [70, 5], 4, 2, 64, 16, seed=7)
    batch.query.mul_(60.0)
    check(batch)


def test_no_sequences(paged_batch):
    batch = paged_batch([1], [20], 4, 2, 64, 16)
    out = cpu_attention.paged_decode_attention(batch.query[:0], batch.k_cache, batch.v_cache,
                                               batch.meta.block_tables[:0], batch.meta.seq_lens[:0], batch.scale)
    assert out.shape == (0, 4, 64)


def test_rejects_bad_inputs(paged_batch):
    batch = paged_batch([1, 1], [20, 30], 4, 2, 64, 16)
    meta = batch.meta
    with pytest.raises(RuntimeError, match="int32"):
        cpu_attention.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables.long(),
                                             meta.seq_lens, batch.scale)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_attention.paged_decode_attention(batch.query.double(), batch.k_cache, batch.v_cache, meta.block_tables,
                                             meta.seq_lens, batch.scale)
    with pytest.raises(RuntimeError, match="query heads"):
        cpu_attention.paged_decode_attention(batch.query[:, :3], batch.k_cache, batch.v_cache, meta.block_tables,
                                             meta.seq_lens, batch.scale)


def test_auto_backend_serves_with_the_kernel_on_cpu():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"
    assert get_ops("cpu").paged_attention is cpu_attention.paged_attention


def test_backend_and_device_must_agree(monkeypatch):
    with pytest.raises(ValueError, match="does not run on device 'cuda'"):
        resolve_backend("cpu", "cuda")
    monkeypatch.setattr(cpu_extension, "_module", None)
    monkeypatch.setattr(cpu_extension, "_error", "OSError: no compiler")
    with pytest.raises(RuntimeError, match="could not be built here .OSError: no compiler"):
        get_ops("cpu")
    assert resolve_backend("auto", "cpu") == "torch"


def test_ninja_from_the_virtualenv_is_put_on_path(monkeypatch):
    """The build needs `ninja` on PATH; when only the pip package's copy exists, its folder is added."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setattr(cpu_extension.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    cpu_extension._put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
