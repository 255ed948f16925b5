"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert) and Qwen3-MoE.

Each MoE layer's experts are held stacked, gate|up as [E, 2I, H] and down as [E, H, I], for ops.fused_moe (the
torch reference, or the Triton grouped GEMM); the router runs in torch on every backend.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

from tandem.workers.layers.moe import select_experts
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.llama import _FUSED_SHARDS, Linear, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tandem.workers.models.qwen3 import Qwen3Attention
from tandem.workers.tensor_parallel import TPGroup

# A per-expert checkpoint tensor (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj) -> (our stacked parameter, half).
_EXPERT_NAME = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                 "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


class Experts(nn.Module):
    """The experts' weights, stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts, plus a sigmoid-gated shared expert where the model has one."""

    def __init__(self, config: ModelConfig, ops: SimpleNamespace):
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(replace(config, intermediate_size=shared), ops) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate.forward(x), self.top_k, self.renormalize)
        out = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, ops, tp, index):
        if config.moe_layers is not None and index not in config.moe_layers:
            return LlamaMLP(config, ops, tp)  # Qwen-MoE's mlp_only_layers / decoder_sparse_step
        return SparseMoeBlock(config, ops)


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen2-MoE: the Llama decoder with SparseMoeBlock MLPs."""

    layer_cls = MoEDecoderLayer
    fused_shards = {**_FUSED_SHARDS, "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
                    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        if tp is not None:
            raise ValueError(f"{config.architecture}: tensor parallelism of mixture-of-experts models is not "
                             "supported yet; use --tensor-parallel-size 1")
        super().__init__(config, ops, tp)

    def quantize_fp8(self) -> None:
        raise ValueError(f"{self.config.architecture}: --quantization fp8 does not cover mixture-of-experts "
                         "weights yet")

    def _map_name(self, hf_name: str):
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
        match = _EXPERT_NAME.match(hf_name)
        if match is None:
            return super()._map_name(hf_name)
        prefix, expert, part = match.groups()
        param, half = _EXPERT_PARTS[part]
        return f"{prefix}.experts.{param}", (int(expert), half)

    def _shard_keys(self, name: str) -> list:
        halves = {"experts.gate_up_proj": (0, 1), "experts.down_proj": (None,)}
        for suffix, parts in halves.items():
            if name.endswith(suffix):
                return [(e, h) for e in range(self.config.num_experts) for h in parts]
        return super()._shard_keys(name)

    def _shard_target(self, name: str, shard, data: torch.Tensor) -> torch.Tensor:
        if ".experts." not in name:
            return super()._shard_target(name, shard, data)
        expert, half = shard
        if half is None:
            return data[expert]
        width = data.shape[1] // 2
        return data[expert].narrow(0, half * width, width)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: MoE layers under Qwen3's attention (per-head q/k RMSNorm)."""

    layer_cls = Qwen3MoeDecoderLayer
