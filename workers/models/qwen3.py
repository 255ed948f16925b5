"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before the rotary embedding."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.workers.models.config import ModelConfig
from tandem.workers.models.llama import Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from tandem.workers.tensor_parallel import TPGroup


def norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` over the last dim of x [T, H, D], each head on its own."""
    return norm.forward(x.reshape(-1, x.shape[-1])).view(x.shape)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        super().__init__(config, ops, tp)
        if config.attention_bias and tp is not None:
            raise ValueError("Qwen3 with attention_bias: tensor parallelism would add o_proj's bias once per rank")
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        if config.attention_bias:  # Qwen3's o_proj has a bias too when its q/k/v do
            self.o_proj = Linear(self.q_size, config.hidden_size, bias=True)

    def project(self, hidden):
        q, k, v = super().project(hidden)
        return norm_heads(self.q_norm, q), norm_heads(self.k_norm, k), v


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
