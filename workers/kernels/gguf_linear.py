"""x W^T on CPU with W read in a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks (csrc/gguf_linear_cpu.cpp).

For the few rows of a decode step this reads 5-6x fewer bytes than the dequantized float32 weight, with the
same weights to the bit (only the summation order differs). The kernel is AVX-512 only and part of the
native CPU extension (cpu_extension.py); `supported()` says whether this machine has it.
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


def gguf_linear(x: torch.Tensor, weight: GGUFBlocks) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> x W^T [M, rows], in x's dtype."""
    module = cpu_extension._module or cpu_extension.load()
    return module.gguf_linear(x, weight.data, int(weight.ggml_type))
