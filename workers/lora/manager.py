"""Adapters known to a worker: registered by name, cached on the host (LRU), resident in device slots (LRU)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from tandem.workers.lora.adapter import AdapterError, LoRAAdapter, load_adapter, model_targets
from tandem.workers.lora.layer import LoRALinear
from tandem.workers.lora.mapping import StepMapping

log = logging.getLogger(__name__)


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules entries, NAME=PATH, as {name: path}."""
    modules = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not NAME=PATH")
        modules[name] = path
    return modules


class LoRAManager:
    """Attaches a LoRALinear to every targetable Linear of `model` and moves adapters between disk, the host
    cache (max_cpu_loras, least recently used out) and the device slots (max_loras, least recently used out
    among those this step does not use)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device):
        if max_loras < 1 or max_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.targets = model_targets(model)
        self.mapping = StepMapping(device)
        by_module: dict[str, list] = {}
        for hf_name, target in self.targets.items():
            by_module.setdefault(target.param, []).append((hf_name, target))
        self.layers: list[LoRALinear] = []
        for entries in by_module.values():
            entries.sort(key=lambda e: e[1].row_start)
            module = entries[0][1].module
            out_features = module.weight.shape[0]
            layer = LoRALinear([(n, t.row_start, t.rows) for n, t in entries], entries[0][1].in_features,
                               out_features, max_loras, max_rank, self.mapping, dtype, device)
            module.lora = layer
            self.layers.append(layer)
        self.paths: dict[str, str] = {}  # every adapter served, by name
        self.versions: dict[str, int] = {}  # bumped when a name is loaded again: its old KV is not reused
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    @property
    def resident(self) -> list[str]:
        """Adapters in a device slot now."""
        return [name for name in self.slots if name is not None]

    def cache_key(self, name: str) -> str:
        """What the adapter's prefix-cache hashes are seeded with: its name, and its load count after a reload."""
        version = self.versions.get(name, 0)
        return name if version == 0 else f"{name}#{version}"

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Reads and checks the adapter (AdapterError naming the reason) and serves it under `name`."""
        if name in self.paths:
            raise AdapterError(f"the LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.targets, self.max_rank)
        if name in self.versions:
            self.versions[name] += 1
        else:
            self.versions[name] = 0
        self.paths[name] = path
        self._cache(adapter)
        log.info("LoRA adapter %s (rank %d, %d modules) from %s", name, adapter.rank, len(adapter.weights), path)
        return adapter

    def remove(self, name: str) -> None:
        """Stops serving `name` (KeyError if unknown); requests already running with it finish first (the engine
        checks) and its slot is reused."""
        del self.paths[name]
        self.cpu.pop(name, None)
        for i, held in enumerate(self.slots):
            if held == name:
                self.slots[i] = None

    def activate(self, names: set[str]) -> dict[str, int]:
        """Each of `names` in a device slot (at most max_loras of them): {name: slot}."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"{len(names)} adapters in one step, --max-loras is {self.max_loras}")
        placed = {}
        for name in names:
            if name in self.slots:
                slot = self.slots.index(name)
            else:
                free = [i for i in self._slot_use if self.slots[i] is None]
                slot = free[0] if free else next(i for i in self._slot_use if self.slots[i] not in names)
                self._load_slot(slot, name)
            self._slot_use.move_to_end(slot)
            placed[name] = slot
        return placed

    def set_step(self, row_slots: list[int], query_lens: list[int]) -> None:
        self.mapping.set(row_slots, query_lens)

    def _load_slot(self, slot: int, name: str) -> None:
        adapter = self.cpu.get(name)
        if adapter is None:
            adapter = load_adapter(name, self.paths[name], self.targets, self.max_rank)
            self._cache(adapter)
        self.cpu.move_to_end(name)
        for layer in self.layers:
            layer.set_slot(slot, adapter.weights)
        self.slots[slot] = name

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
