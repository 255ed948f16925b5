"""Picks the implementation of the model's non-GEMM ops: the torch reference path, the torch path with the
native CPU paged-attention kernel ("cpu"), or the Triton kernels (GPU)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from tandem.workers.layers import activation, attention, moe, norm, rotary

BACKENDS = ("torch", "cpu", "triton")

# op name -> (torch reference module, Triton kernel module under tandem.workers.kernels)
_OPS = {
    "rms_norm": (norm, "rmsnorm"),
    "fused_add_rms_norm": (norm, "rmsnorm"),
    "apply_rotary": (rotary, "rope"),
    "silu_and_mul": (activation, "activation"),
    "write_kv_cache": (attention, "cache_write"),
    "paged_attention": (attention, "paged_attention"),
    "fused_moe": (moe, "fused_moe"),
}


def get_ops(backend: str = "torch") -> SimpleNamespace:
    """A namespace with rms_norm, fused_add_rms_norm, apply_rotary, silu_and_mul, write_kv_cache,
    paged_attention, fused_moe and compute_cos_sin_cache (always the torch one: it runs once at load time)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown ops backend {backend!r}; expected one of {BACKENDS}")
    ops = {"compute_cos_sin_cache": rotary.compute_cos_sin_cache}
    for name, (torch_module, kernel_module) in _OPS.items():
        if backend == "triton":
            module = importlib.import_module(f"tandem.workers.kernels.{kernel_module}")
            ops[name] = getattr(module, name)
        else:
            ops[name] = getattr(torch_module, name)
    if backend == "cpu":
        from tandem.workers.kernels import cpu_attention, cpu_extension

        if not cpu_extension.available():
            raise RuntimeError(f"attention backend 'cpu': the CPU kernel could not be built here "
                               f"({cpu_extension.build_error()}); use 'torch' or 'auto'")
        ops["paged_attention"] = cpu_attention.paged_attention
    return SimpleNamespace(backend=backend, **ops)


def resolve_backend(backend: str, device: str) -> str:
    """What "auto" means on `device`: Triton on CUDA; on CPU the native paged-attention kernel when it builds
    here (see kernels/cpu_extension.py), else the torch path."""
    if backend == "cpu" and not device.startswith("cpu"):
        raise ValueError(f"attention backend 'cpu' does not run on device {device!r}")
    if backend != "auto":
        return backend
    if device.startswith("cuda"):
        return "triton"
    from tandem.workers.kernels import cpu_extension

    return "cpu" if cpu_extension.available() else "torch"
