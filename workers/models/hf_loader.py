"""Reads a HuggingFace checkpoint folder: config.json -> ModelConfig, and its safetensors tensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace

import torch
from safetensors import safe_open

from tandem.workers.models.config import ModelConfig
from tandem.workers.models.registry import family_for_hf


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers v4 fields (rope_theta + rope_scaling) or v5's
    rope_parameters (which holds rope_theta and the scaling keys together)."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # Gemma 3 has one set per layer type: the global layers'
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) in (None, "default"):
        scaling = None
    return float(theta), scaling


def _moe_settings(cfg: dict) -> dict:
    """The ModelConfig mixture-of-experts fields of a Mixtral or Qwen-MoE config.json (none for a dense model)."""
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not num_experts:
        return {}
    layers = cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        # Mixtral always renormalises; Qwen-MoE says so with norm_topk_prob (false when absent).
        norm_topk_prob=bool(cfg.get("norm_topk_prob", "num_local_experts" in cfg)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        moe_layers=None if len(moe_layers) == layers else moe_layers,
    )


def _gemma_settings(cfg: dict) -> dict:
    """Gemma 2 / 3's ModelConfig fields: soft-capping, attention scale, sliding-window layers, local rope base."""
    if "query_pre_attn_scalar" not in cfg:
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # configs from before layer_types: Gemma 2 alternates, Gemma 3 has 1 global in `pattern`
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 2
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
    return dict(
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=[i for i, kind in enumerate(types) if kind == "sliding_attention"],
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        rope_local_theta=None if local is None else float(local),
    )


def load_hf_config(model_dir: str) -> ModelConfig:
    """config.json (+ generation_config.json's eos ids, when present) -> ModelConfig."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{model_dir!r} has no config.json")
    cfg = _read_json(config_path)
    model_type = cfg.get("model_type")
    family = family_for_hf(cfg.get("architectures"), model_type)
    if cfg.get("mlp_bias"):
        raise ValueError(f"{config_path}: mlp_bias=true is not supported")
    num_heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _rope_settings(cfg)
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{config_path}: partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    max_positions = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3") or cfg.get("use_sliding_window") else None
    if window:
        # Attention here is always full: cap the context at the window, within which the two agree.
        max_positions = min(max_positions, window)
    eos_ids = _as_id_list(cfg.get("eos_token_id"))
    generation_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_path):
        eos_ids += [i for i in _as_id_list(_read_json(generation_path).get("eos_token_id")) if i not in eos_ids]
    config = ModelConfig(
        architecture=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        # Mistral configs carry "head_dim": null.
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=os.path.basename(os.path.normpath(model_dir)),
        **_moe_settings(cfg),
        **_gemma_settings(cfg),
    )
    return replace(config, **family.config)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's shard files: those named by model.safetensors.index.json, else every *.safetensors."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        names = sorted(set(_read_json(index_path)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")
    paths = [os.path.join(model_dir, n) for n in names]
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"safetensors shard {path!r} named by the index is missing")
    return paths


def iter_hf_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) for every tensor of the checkpoint, one shard open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
