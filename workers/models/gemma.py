"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorms before and after attention and MLP, embeddings scaled by
sqrt(hidden), GELU-tanh MLP, attention scaled by query_pre_attn_scalar, sliding-window layers, and Gemma 2's
tanh soft-capping of attention scores and final logits; Gemma 3 adds per-head q/k norms and a local rope base.

Soft-capping and sliding windows are computed by the torch attention path only (the native CPU kernel's layers
fall back to it); the Triton attention kernel does not compute them, so these models are refused on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.layers import attention
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tandem.workers.models.qwen3 import norm_heads
from tandem.workers.tensor_parallel import TPGroup


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight)."""

    def __init__(self, hidden_size: int, eps: float, ops: SimpleNamespace):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        out = self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None, index: int):
        super().__init__(config, ops, tp)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.sliding_window if index in config.sliding_layers else None
        self.qk_norm = config.architecture == "gemma3"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, ops)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def project(self, hidden):
        q, k, v = super().project(hidden)
        if self.qk_norm:
            q, k = norm_heads(self.q_norm, q), norm_heads(self.k_norm, k)
        return q, k, v

    def attend(self, q, k_cache, v_cache, meta):
        if self.softcap is None and self.window is None:
            return super().attend(q, k_cache, v_cache, meta)
        return attention.paged_attention(q, k_cache, v_cache, meta, self.scale, self.softcap, self.window,
                                         k_scale=self.k_scale, v_scale=self.v_scale)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None, index: int = 0):
        super().__init__()
        self.self_attn = GemmaAttention(config, ops, tp, index)
        self.mlp = GemmaMLP(config, ops, tp)
        norm = (config.hidden_size, config.rms_norm_eps, ops)
        self.input_layernorm = GemmaRMSNorm(*norm)
        self.post_attention_layernorm = GemmaRMSNorm(*norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.post_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.local_rope = config.rope_local_theta is not None and index in config.sliding_layers

    def forward(self, positions, hidden, residual, k_cache, v_cache, meta, cos_sin_cache):
        cos_sin = cos_sin_cache[1] if self.local_rope else cos_sin_cache[0]
        attended = self.self_attn.forward(positions, self.input_layernorm.forward(hidden), k_cache, v_cache, meta,
                                          cos_sin)
        hidden = hidden + self.post_attention_layernorm.forward(attended)
        return hidden + self.post_feedforward_layernorm.forward(
            self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))), None


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text models (tied head)."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        needs = [what for what, value in (("attention soft-capping", config.attn_logit_softcapping),
                                          ("sliding-window layers", config.sliding_layers)) if value]
        if needs and ops.backend == "triton":
            raise ValueError(f"{config.architecture} needs {' and '.join(needs)}, which the Triton attention kernel "
                             "does not compute yet; serve it on the CPU (--device cpu)")
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"{config.architecture}: activation {config.hidden_act!r} is not supported")
        super().__init__(config, ops, tp)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def _build_cos_sin_cache(self):
        """(global layers' cache, sliding layers' cache): Gemma 3's sliding layers rotate with their own base."""
        full = super()._build_cos_sin_cache()
        if self.config.rope_local_theta is None:
            return full, full
        with torch.device("cpu"):
            local = self.ops.compute_cos_sin_cache(self.config.head_dim, self.config.max_position_embeddings,
                                                   self.config.rope_local_theta, None)
        return full, local

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, meta):
        if self.cos_sin_cache[0].device != input_ids.device:
            self.cos_sin_cache = tuple(cache.to(input_ids.device) for cache in self.cos_sin_cache)
        hidden = self._embed(input_ids)
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        for layer, (k_cache, v_cache) in zip(self.model.layers, self._layer_cache_views(kv_cache), strict=True):
            hidden, _ = layer.forward(positions, hidden, None, k_cache, v_cache, meta, self.cos_sin_cache)
        return self.model.norm.forward(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

