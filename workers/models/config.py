"""Architecture hyper-parameters of a decoder-only model, read from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str  # a family of tandem.workers.models.registry (Mistral and SmolLM2 are llama)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None  # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"  # the served name by default
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights rescaled to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, gated by a sigmoid (0: none)
    moe_layers: list[int] | None = None  # the layers whose MLP is the experts (None: all)

    # Gemma 2 / 3.
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    sliding_window: int | None = None  # positions a sliding-window layer's query sees, its own included
    sliding_layers: list[int] = field(default_factory=list)  # the layers that attend through that window
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5, not head_dim's
    rope_local_theta: float | None = None  # Gemma 3's sliding layers' rope base (no scaling)
