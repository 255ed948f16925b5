"""x W^T on CPU with W read in a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks (csrc/gguf_linear_cpu.cpp).

AVX-512 only, part of the native CPU extension (cpu_extension.py); `supported()` says whether this machine has
it. Why: docs/design/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from tandem.workers.kernels import cpu_extension

BLOCK_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


@dataclass(frozen=True)
class GGUFBlocks:
    """A [rows, K] weight as the file stores it: row r is K/32 blocks, data uint8 [rows, K/32 * block bytes]."""

    ggml_type: GGMLQuantizationType
    data: torch.Tensor


def supported() -> bool:
    module = cpu_extension.load()
    return module is not None and module.gguf_linear_supported()


def gguf_linear(x: torch.Tensor, weight: GGUFBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> x W^T (+ bias) [M, rows], in x's dtype."""
    out = cpu_extension.load().gguf_linear(x, weight.data, int(weight.ggml_type))
    return out if bias is None else out.add_(bias)
