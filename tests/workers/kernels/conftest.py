"""Kernel tests run the Triton kernels on a GPU when there is one, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before the kernel modules are imported (triton.jit decides at decoration
time), which is why this happens at the top of the conftest, before any test module is collected.

Interpreter runs are float32 only: Triton 3.9's interpreter truncates float32 -> bfloat16 casts (the GPU
rounds to nearest even) and multiplies bfloat16 tl.dot operands as raw 16-bit integers, so bf16 results
there say nothing about the kernels. bf16 is covered by the @pytest.mark.gpu tests.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    _early = sorted(name for name in sys.modules if name.startswith("tandem.workers.kernels."))
    if _early:
        raise pytest.UsageError(
            f"{_early} were imported before tests/workers/kernels/conftest.py could set TRITON_INTERPRET=1, so they "
            "were compiled for a GPU this machine lacks; run with TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.workers.layers.metadata import AttentionMetadata  # noqa: E402


@pytest.fixture(scope="module")
def cpu_extension_built():
    """The native CPU kernels' extension, for the modules that test them. Where a C++ compiler is present
    (CI, a developer's machine) it must build: a build failure fails those tests rather than skipping them,
    since "auto" would silently serve with the slower torch paths."""
    from tandem.workers.kernels import cpu_extension

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: the CPU kernels cannot be built (workers use the torch paths)")
    assert cpu_extension.available(), f"the CPU kernels did not build: {cpu_extension.build_error()}"


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not HAS_CUDA:
        pytest.skip("needs a CUDA device")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


class PagedBatch:
    """A random flattened batch over a paged KV cache laid out as the engine lays it out.

    kv_cache is [num_blocks, num_layers, 2, block_size, Hkv, D] and the layer under test is read through
    the strided views kv_cache[:, layer, 0/1]. Block tables hand out the blocks in shuffled order (plus
    spare blocks nobody owns), so contiguous tables would not hide indexing bugs.
    """

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        generator: torch.Generator,
        num_layers: int = 3,
        layer: int = 1,
        padding_tokens: int = 0,
        shared_prefix_blocks: int = 0,
    ):
        if len(query_lens) != len(seq_lens) or any(
            q > s or q < 1 for q, s in zip(query_lens, seq_lens, strict=True)
        ):
            raise ValueError(f"bad batch: query_lens {query_lens}, seq_lens {seq_lens}")
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        # Sequences may share their first blocks, as after a prefix-cache hit.
        shared = shared_prefix_blocks
        num_blocks = shared + sum(n - min(shared, n) for n in blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
        next_block = shared
        for b, n in enumerate(blocks_per_seq):
            own = n - min(shared, n)
            tables[b, : min(shared, n)] = order[: min(shared, n)]
            tables[b, min(shared, n) : n] = order[next_block : next_block + own]
            next_block += own
        # Data is drawn on the device (full-size GPU caches are GBs); the structure above on the CPU.
        data_gen = torch.Generator(device=device).manual_seed(
            int(torch.randint(2**31, (1,), generator=generator))
        )
        self.kv_cache = torch.randn(
            num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=data_gen, device=device
        ).to(dtype)
        self.k_cache = self.kv_cache[:, layer, 0]
        self.v_cache = self.kv_cache[:, layer, 1]
        num_tokens = sum(query_lens)
        self.query = torch.randn(
            num_tokens + padding_tokens, num_q_heads, head_dim, generator=data_gen, device=device
        ).to(dtype)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        slots = []
        for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            for pos in range(s - q, s):
                slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [-1] * padding_tokens, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        self.num_tokens = num_tokens
        self.scale = head_dim**-0.5


@pytest.fixture
def paged_batch(device):
    """Factory: paged_batch(query_lens, seq_lens, Hq, Hkv, D, block_size, dtype=..., seed=..., **kw)."""

    def make(*shape, dtype=torch.float32, seed=0, **kw):
        return PagedBatch(*shape, dtype, device, torch.Generator().manual_seed(seed), **kw)

    return make
