"""The GEMV over GGUF quantized blocks (tandem.workers.kernels.gguf_linear) against numpy dequantization.

Blocks are made with gguf.quants.quantize and the reference is x @ dequantize(blocks).T in float64, so the
tolerances measure the kernel's float32 summation alone. A one-hot x reads the weights back one by one:
they must equal gguf's dequantization to the bit.

Where a C++ compiler is present the extension must build (a failure fails these tests); the kernel itself
needs AVX-512, and on a CPU without it these tests skip and say so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tandem.workers.kernels import gguf_linear
from tandem.workers.kernels.gguf_linear import GGUFBlocks


@pytest.fixture(scope="module", autouse=True)
def kernel_built(cpu_extension_built):  # tests/workers/kernels/conftest.py: the extension must build here
    if not gguf_linear.supported():
        pytest.skip("this CPU lacks AVX-512: the GGUF GEMV is not built (workers use the float weights)")


def make_weight(rows: int, cols: int, ggml_type: Q, seed: int = 0) -> tuple[GGUFBlocks, torch.Tensor]:
    """Random weights quantized to ggml_type: (the blocks, their float32 dequantization by gguf)."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(weight, ggml_type)
    dense = dequantize(blocks, ggml_type).reshape(rows, cols).astype(np.float32)
    return GGUFBlocks(ggml_type, torch.from_numpy(blocks.reshape(rows, -1).copy())), torch.from_numpy(dense)


@pytest.mark.parametrize("ggml_type", gguf_linear.BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows_of_x", [1, 2, 5, 8, 9, 19])  # chunks of 8 rows: whole, partial, several
@pytest.mark.parametrize("cols", [64, 576])
def test_matches_dequantized_weights_in_float32(ggml_type, rows_of_x, cols):
    blocks, dense = make_weight(70, cols, ggml_type)  # 70 rows: thread ranges of uneven size
    x = torch.randn(rows_of_x, cols, generator=torch.Generator().manual_seed(1))
    out = gguf_linear.gguf_linear(x, blocks)
    assert out.shape == (rows_of_x, 70) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ dense.double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ggml_type", gguf_linear.BLOCK_TYPES, ids=lambda t: t.name)
def test_bfloat16_rows_are_computed_in_float32(ggml_type):
    blocks, dense = make_weight(48, 128, ggml_type)
    x = torch.randn(3, 128).bfloat16()
    out = gguf_linear.gguf_linear(x, blocks)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), x.double() @ dense.double().T, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("ggml_type", gguf_linear.BLOCK_TYPES, ids=lambda t: t.name)
def test_weights_are_gguf_dequantization_to_the_bit(ggml_type):
    blocks, dense = make_weight(40, 96, ggml_type, seed=3)
    one_hot = torch.eye(96)
    assert torch.equal(gguf_linear.gguf_linear(one_hot, blocks), dense.T)


def test_empty_x_gives_empty_output():
    blocks, _ = make_weight(16, 64, Q.Q8_0)
    assert gguf_linear.gguf_linear(torch.empty(0, 64), blocks).shape == (0, 16)


def test_bad_inputs_are_refused():
    blocks, _ = make_weight(16, 64, Q.Q4_1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gguf_linear.gguf_linear(torch.randn(1, 48), GGUFBlocks(Q.Q4_1, blocks.data[:, :30].contiguous()))
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[N, 36\]"):
        gguf_linear.gguf_linear(torch.randn(1, 64), GGUFBlocks(Q.Q4_0, blocks.data))  # Q4_1 blocks, 40 bytes a row
    with pytest.raises(RuntimeError, match="unsupported GGUF block type 12"):
        gguf_linear.gguf_linear(torch.randn(1, 64), GGUFBlocks(Q.Q4_K, blocks.data))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gguf_linear.gguf_linear(torch.randn(1, 64, dtype=torch.float64), blocks)
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\]"):
        gguf_linear.gguf_linear(torch.randn(64), blocks)
