"""Rotary position embeddings (HF "rotate_half" / NeoX layout) with the scaling variants Llama models use."""

from __future__ import annotations

import math

import torch

from tandem.workers.layers.memo import StepMemo


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band in between
    # interpolated. Written exactly as transformers computes it so both produce the same float32 values.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def _scaled_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(head_dim, base)
    if not rope_scaling:
        return inv_freq
    # Older configs call the field "type", newer ones "rope_type".
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        # What llama.cpp stores for Llama 3.1 GGUFs instead of the llama3 parameters (the `rope_freqs`
        # tensor): one divisor per frequency.
        factors = torch.as_tensor(rope_scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def compute_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, rope_scaling: dict | None = None
) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos(pos * inv_freq) in the first half, sin in the second."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    inv_freq = _scaled_inv_freq(head_dim, base, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


# Every layer of a forward pass asks for the same positions' rows.
_cos_sin_memo = StepMemo()


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) of shape [T, 1, D] in `dtype`, with the sign of rotate_half folded into sin's first half."""
    cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # HF: x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). roll gives cat(x2, x1) and the
    # sign lives in signed_sin; negation is exact, so the result is bit for bit the same.
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return rotated.add_(x * cos)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] by their token positions [T]; returns new tensors."""
    cos, signed_sin = _cos_sin_memo.get(
        (positions, cos_sin_cache, q.dtype), lambda: _cos_sin(positions, cos_sin_cache, q.dtype)
    )
    return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)
