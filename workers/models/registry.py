"""Which model class runs a checkpoint, keyed by its HF `architectures` or its GGUF `general.architecture`."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """A model family: its ModelConfig.architecture, its class ("module:Class" here), the names checkpoints give it."""

    name: str
    model: str
    hf: tuple[str, ...]  # config.json `architectures`
    model_types: tuple[str, ...] = ()  # config.json `model_type`, for configs without `architectures`
    gguf: tuple[str, ...] = ()  # GGUF `general.architecture`
    config: dict = field(default_factory=dict)  # ModelConfig fields the whole family has, whatever config.json says


# Adding a family: its module under tandem.workers.models and one line here.
FAMILIES = (
    Family("llama", "llama:LlamaForCausalLM", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"),
           ("llama",)),
    Family("qwen2", "llama:LlamaForCausalLM", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), {"attention_bias": True}),
    Family("qwen3", "qwen3:Qwen3ForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",)),
    Family("phi3", "llama:LlamaForCausalLM", ("Phi3ForCausalLM",), ("phi3",)),  # checkpoints fuse qkv and gate/up
    Family("gemma2", "gemma:GemmaForCausalLM", ("Gemma2ForCausalLM",), ("gemma2",), config={"tie_word_embeddings": True}),
    Family("gemma3", "gemma:GemmaForCausalLM", ("Gemma3ForCausalLM",), ("gemma3_text",),
           config={"tie_word_embeddings": True}),
    Family("mixtral", "moe:MoEForCausalLM", ("MixtralForCausalLM",), ("mixtral",)),
    Family("qwen2_moe", "moe:MoEForCausalLM", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), config={"attention_bias": True}),
    Family("qwen3_moe", "moe:Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3_moe",)),
)


def supported_hf() -> list[str]:
    return sorted(name for family in FAMILIES for name in family.hf)


def supported_gguf() -> list[str]:
    return sorted(name for family in FAMILIES for name in family.gguf)


def family_for_hf(architectures: list[str] | None, model_type: str | None) -> Family:
    """The family of a config.json (the first of its `architectures` known here, else its model_type)."""
    names = list(architectures or [])
    for name in names:
        for family in FAMILIES:
            if name in family.hf:
                return family
    if not names:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    named = ", ".join(names) if names else f"model_type {model_type!r}"
    raise ValueError(f"unsupported architecture {named} (supported: {', '.join(supported_hf())})")


def family_for_gguf(architecture: str | None) -> Family:
    """The family of a GGUF file whose general.architecture is `architecture`."""
    for family in FAMILIES:
        if architecture in family.gguf:
            return family
    raise ValueError(f"unsupported GGUF architecture {architecture!r} (supported: {', '.join(supported_gguf())})")


def family(name: str) -> Family:
    """The family whose ModelConfig.architecture is `name`."""
    for candidate in FAMILIES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown model family {name!r} (known: {', '.join(f.name for f in FAMILIES)})")


def model_class(name: str) -> type:
    """The class that runs family `name`."""
    module, _, cls = family(name).model.partition(":")
    return getattr(importlib.import_module(f"tandem.workers.models.{module}"), cls)


def check_hf_folder(path: str) -> None:
    """Refuses (ValueError, one line) a HF checkpoint folder whose config.json names no family known here."""
    config_path = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        family_for_hf(config.get("architectures"), config.get("model_type"))
