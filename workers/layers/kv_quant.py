"""FP8 KV cache (`--kv-cache-dtype fp8`): the storage dtype, per-tensor scales, and the torch (de)quantization."""

from __future__ import annotations

import re

import torch

from tandem.workers.layers.fp8_linear import FP8 as FP8_KV
from tandem.workers.layers.fp8_linear import FP8_MAX

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# Per-tensor KV scales as checkpoints store them: compressed-tensors / vLLM (self_attn.k_scale), AutoFP8's older
# k_proj.k_scale, ModelOpt's k_proj.output_scale, and the deprecated single kv_scale (both).
_SCALE_NAMES = (
    re.compile(r"layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k|v|kv)_scale$"),
    re.compile(r"layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"),
)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: the model's for "auto", e4m3 for "fp8" / "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, clamped to e4m3's range, rounded to nearest even e4m3."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype` (the product taken in float32)."""
    if scale == 1.0:
        return x.to(dtype)  # exact: e4m3 values are representable in float32, float16 and bfloat16
    return x.float().mul_(scale).to(dtype)


def kv_scale_name(hf_name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when a checkpoint tensor is a KV cache scale, else None."""
    for pattern in _SCALE_NAMES:
        found = pattern.search(hf_name)
        if found:
            return int(found.group(1)), found.group(2)
    return None


def scale_value(hf_name: str, tensor: torch.Tensor) -> float:
    """A per-tensor KV scale's value; a per-head or non-positive one is refused."""
    if tensor.numel() != 1:
        raise ValueError(f"KV scale {hf_name!r} has {tensor.numel()} values; only per-tensor scales are supported")
    value = float(tensor.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KV scale {hf_name!r} is {value}; it must be a positive finite number")
    return value
