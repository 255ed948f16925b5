"""Reads a PEFT LoRA adapter (adapter_config.json + weights) and checks it against the base model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

# The projections an adapter may target (their leaf names in HF checkpoints).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter this worker cannot serve; the message names the reason."""


@dataclass
class Target:
    """Where one HF projection of one layer lives in our model: a Linear, and its output rows."""

    module: nn.Module
    param: str  # the Linear's dotted name in our model
    row_start: int
    rows: int
    in_features: int


@dataclass
class LoRAAdapter:
    """One adapter's weights: per HF module name (e.g. model.layers.0.self_attn.q_proj), A [r, in] and
    B [out, r] with the scaling folded into B, in float32 on the CPU."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def model_targets(model: nn.Module) -> dict[str, Target]:
    """Every projection an adapter may target in `model`, by HF module name."""
    targets: dict[str, Target] = {}
    for layer_index, _ in enumerate(model.model.layers):
        for leaf in TARGETS:
            group = "self_attn" if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            hf_name = f"model.layers.{layer_index}.{group}.{leaf}"
            param, shard = model._map_name(hf_name + ".weight")
            try:
                module = model.get_submodule(param.rpartition(".")[0])
            except AttributeError:
                continue
            if not hasattr(module, "weight") or getattr(module, "is_fp8", False):
                continue
            out_features, in_features = module.weight.shape
            start, rows = 0, out_features
            if shard is not None:
                sizes = model._fused_owner(param).shard_sizes
                start, rows = sum(sizes[:shard]), sizes[shard]
            targets[hf_name] = Target(module, param, start, rows, in_features)
    return targets


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise AdapterError(f"{path} has no adapter_config.json")
    with open(config_path) as f:
        return json.load(f)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise AdapterError(f"{path} has no adapter_model.safetensors (or adapter_model.bin)")


def _check_config(config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config, or AdapterError naming what is not served."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank > max_rank:
        raise AdapterError(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{key} (ranks or alphas per module) is not supported")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError("adapters that train biases or whole modules (modules_to_save) are not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise AdapterError(f"unknown target module {unknown[0]!r}: LoRA applies to {', '.join(TARGETS)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def load_adapter(name: str, path: str, targets: dict[str, Target], max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at `path`: AdapterError naming the reason when it does not fit."""
    rank, scaling = _check_config(_read_config(path), max_rank)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, dot, kind = key.removesuffix(".weight").rpartition(".")
        if not dot or kind not in ("lora_A", "lora_B"):
            raise AdapterError(f"unexpected tensor {key!r} in the adapter")
        pairs.setdefault(module.removeprefix("base_model.model."), {})[kind] = tensor
    weights = {}
    for module, pair in pairs.items():
        leaf = module.rpartition(".")[2]
        if leaf not in TARGETS:
            raise AdapterError(f"unknown target module {leaf!r}: LoRA applies to {', '.join(TARGETS)}")
        target = targets.get(module)
        if target is None:
            raise AdapterError(f"target {module!r} does not exist in the base model")
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{module!r} lacks its lora_A or lora_B weight")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if a.shape != (rank, target.in_features) or b.shape != (target.rows, rank):
            raise AdapterError(f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                               f"base model (expected ({rank}, {target.in_features}) and ({target.rows}, {rank}))")
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise AdapterError("the adapter has no LoRA weights")
    return LoRAAdapter(name, path, rank, weights)
