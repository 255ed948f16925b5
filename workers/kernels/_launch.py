"""What every kernel wrapper checks before a launch: that the kernel can run where the tensors are."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_runnable(kernel, tensor: torch.Tensor, op: str) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors need the kernels built by Triton's interpreter,
    which triton.jit picks at import time when TRITON_INTERPRET=1."""
    if tensor.device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return
    raise ValueError(
        f"{op}: the Triton kernels need CUDA tensors, got {tensor.device}. On a CPU use the torch ops "
        "backend, or set TRITON_INTERPRET=1 before tandem.workers.kernels is imported to run them in "
        "Triton's interpreter"
    )
