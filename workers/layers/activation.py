"""SwiGLU activation over the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is [T, 2I] with the gate in the first half and the up projection in the second; returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
