"""The low-rank update of one Linear for every adapter slot, added to its output row by row."""

from __future__ import annotations

import torch

from tandem.workers.lora.mapping import StepMapping


class LoRALinear:
    """Slot-stacked weights of one (possibly fused) Linear: A [S, n*R, in] holds each slice's A in its own R
    rows, B [S, out, n*R] is block-diagonal (slice i's B in its output rows and R columns), so one shrink and
    one expand apply every slice of a fused qkv or gate_up projection. Zeros where a slot's adapter does not
    target a slice."""

    def __init__(self, slices: list[tuple[str, int, int]], in_features: int, out_features: int, num_slots: int,
                 max_rank: int, mapping: StepMapping, dtype: torch.dtype, device: torch.device):
        self.slices = slices  # (HF module name, first output row, rows), in row order
        self.max_rank = max_rank
        self.mapping = mapping
        width = len(slices) * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes an adapter's A and B (scaling folded in) into `slot`; slices it does not target get zeros."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, (name, row_start, rows) in enumerate(self.slices):
            pair = weights.get(name)
            if pair is None:
                continue
            a, b = pair
            col = i * self.max_rank
            self.a[slot, col:col + a.shape[0]].copy_(a)
            self.b[slot, row_start:row_start + rows, col:col + b.shape[1]].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += (x A_s^T) B_s^T for each row's slot s; rows of the base model are left as they are."""
        for slot, rows in self.mapping.groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ self.a[slot].T) @ self.b[slot].T
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
        return y
