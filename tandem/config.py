"""Configuration models: the single source of truth for engine, worker and CLI settings.

The LLMDeployment CRD (operator issue) is generated from models in this module too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tandem.hashing import DEFAULT_BLOCK_SIZE

Role = Literal["prefill", "decode", "both"]


class EngineConfig(BaseModel):
    """Settings of one engine instance (one worker process)."""

    model: str = Field("smollm2", description="'smollm2', a HF checkpoint folder, or a .gguf file")
    served_model_name: str | None = Field(None, description="name clients use; defaults to the model's")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = Field("auto", description="'auto' picks cuda when present, else cpu")
    max_model_len: int | None = Field(None, ge=1, description="defaults to the model's context length")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache size in blocks; overrides kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV cache size when num_kv_blocks is not given")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1, description="per-step token budget (chunked prefill)")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0


class WorkerConfig(BaseModel):
    """Settings of the worker HTTP server around an engine."""

    role: Role = "both"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1, description="larger request bodies get 413")
    engine: EngineConfig = Field(default_factory=EngineConfig)
