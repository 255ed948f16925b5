"""The wrappers' guard against launching compiled kernels on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.kernels._launch import check_runnable
from tandem.workers.kernels.activation import _silu_and_mul_kernel


def test_compiled_kernel_on_cpu_tensor_is_refused():
    compiled_stand_in = object()  # anything that is not an interpreter-built kernel
    with pytest.raises(ValueError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
        check_runnable(compiled_stand_in, torch.empty(1), "silu_and_mul")


def test_interpreted_kernel_on_cpu_tensor_is_accepted():
    if torch.cuda.is_available():
        pytest.skip("kernels are compiled, not interpreted, when a GPU is present")
    check_runnable(_silu_and_mul_kernel, torch.empty(1), "silu_and_mul")
