"""Which adapter slot each token of a step uses, grouped once per step for every layer to read."""

from __future__ import annotations

import torch


class StepMapping:
    """A step's token -> slot assignment: `groups` lists (slot, row indices or None for every row) for the
    rows that use an adapter; rows of the base model are in no group."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set(self, row_slots: list[int], query_lens: list[int]) -> None:
        """Per sequence row its slot (-1: none) and its token count this step."""
        self.groups = []
        if all(slot < 0 for slot in row_slots):
            return
        token_slots = [slot for slot, n in zip(row_slots, query_lens, strict=True) for _ in range(n)]
        distinct = sorted({slot for slot in row_slots if slot >= 0})
        if len(distinct) == 1 and min(row_slots) >= 0:
            self.groups = [(distinct[0], None)]
        else:
            slots = torch.tensor(token_slots, dtype=torch.int64)
            self.groups = [(slot, (slots == slot).nonzero().flatten().to(self.device)) for slot in distinct]
