"""Llama-family decoder (Llama 2/3/3.1, SmolLM2, Mistral) and Qwen2 (q/k/v bias) on a paged KV cache.

Parameter names follow transformers' LlamaForCausalLM except that q/k/v are fused into
`self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj`: one GEMM each instead of three and two, which is
most of what makes batch-1 decode cheap. `load_weights` maps HF names onto the fused parameters.

Inside the model, submodules are called through `.forward`: nn.Module.__call__ (hook dispatch) costs time on
every call, there are several calls per layer in every decode step, and this model registers no hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.kernels.gguf_linear import GGUFBlocks, gguf_linear
from tandem.workers.layers import kv_quant
from tandem.workers.layers.fp8_linear import FP8, fp8_linear, quantize_weight
from tandem.workers.layers.metadata import AttentionMetadata
from tandem.workers.models.config import ModelConfig
from tandem.workers.tensor_parallel import HeadShard, TPGroup, check_sizes

# HF parameter -> (our fused parameter, index of its shard within it)
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class PackedWeight:
    """A [out, in] weight reordered once into oneDNN's blocked layout, for CPU GEMMs.

    F.linear gives MKL the plain row-major weight on every call, and for the few rows of a decode batch that
    is far from what the CPU can do: float32 GEMMs of a few rows and up, and bfloat16 ones at every row count
    (AMX), run faster from the packed copy. The copy costs as much memory again as the weight; it is rebuilt if
    the weight is written (its version counter moves).
    """

    def __init__(self):
        self._source: torch.Tensor | None = None
        self._version: int | None = -1
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        # Inference tensors keep no version counter (and are written only inside inference mode).
        version = None if weight.is_inference() else weight._version
        if self._packed is None or self._source is not weight or self._version != version:
            with torch.inference_mode():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._source, self._version = weight, version
        return self._packed


_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
# float32 GEMMs with fewer rows than this stay on F.linear: MKL's GEMV path is faster there (and is what
# transformers runs, so batch-1 decode matches it bit for bit).
_MIN_PACKED_F32_ROWS = 4


def _use_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dim() != 2 or not _ONEDNN:
        return False
    if x.dtype == torch.float32:
        return x.shape[0] >= _MIN_PACKED_F32_ROWS
    return x.dtype == torch.bfloat16 and _ONEDNN_BF16


# GEMMs with at most this many rows read GGUF-quantized weights in their blocks when the model has them
# (attach_gguf_blocks): the decode steps of small batches, which are bound by reading the weights. Beyond,
# the float weights' GEMM wins: benchmarks/engine_cpu.py (d) times both by rows (float32 breaks even near 32
# rows; bfloat16, on AMX, beyond 8). docs/benchmarks.md has the figures.
MAX_GGUF_BLOCK_ROWS = {torch.float32: 16, torch.bfloat16: 8}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
           blocks: GGUFBlocks | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): from the weight's GGUF blocks for a few rows when it has them, else through
    the pre-packed oneDNN weight where that is faster."""
    if blocks is not None and x.dim() == 2 and x.shape[0] <= MAX_GGUF_BLOCK_ROWS.get(x.dtype, 0):
        return gguf_linear(x, blocks, bias)
    if _use_packed(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def head_shard(config: ModelConfig, tp: TPGroup | None) -> HeadShard:
    """The query and KV heads this rank holds (all of them without tensor parallelism)."""
    if tp is None:
        return HeadShard(0, config.num_heads, 0, config.num_kv_heads)
    return HeadShard.of(tp.rank, tp.size, config.num_heads, config.num_kv_heads)


def vocab_rows(config: ModelConfig, tp: TPGroup | None) -> int:
    """Rows of the embedding and LM head this rank holds: the vocabulary in equal parts, the last padded."""
    return config.vocab_size if tp is None else -(-config.vocab_size // tp.size)


class Gemm(NamedTuple):
    """One GEMM of the model as linear() takes it: float weight, bias, packed copy, GGUF blocks if any."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: PackedWeight
    blocks: GGUFBlocks | None


class Linear(nn.Module):
    """y = x W^T (+ b) with uninitialised parameters: load_weights fills them, so random init (slow for
    large models) is skipped. `fp8`: the weight is held in FP8 with a float32 scale per output channel
    (`weight_scale`), as an FP8 checkpoint stores it; quantize_fp8 turns a float one into that
    (tandem.workers.layers.fp8_linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fp8: bool = False):
        super().__init__()
        if fp8:
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = PackedWeight()
        self.gguf_blocks: GGUFBlocks | None = None  # the same weight as the file's quantized blocks, on CPU
        self.lora = None  # the adapters' low-rank update (tandem.workers.lora.layer.LoRALinear), when serving LoRA

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            y = fp8_linear(x, self.weight, self.weight_scale, self.bias)
        else:
            y = linear(x, self.weight, self.bias, self.packed, self.gguf_blocks)
        return y if self.lora is None else self.lora.apply(x, y)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Holds the weight in FP8 from now on (quantize_weight); the float copy is freed."""
        q, scales = quantize_weight(self.weight.data)
        del self.weight
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scales)
        self.packed, self.gguf_blocks = PackedWeight(), None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: SimpleNamespace):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        super().__init__()
        if config.num_heads % config.num_kv_heads:
            raise ValueError(
                f"num_heads ({config.num_heads}) must be a multiple of num_kv_heads ({config.num_kv_heads})"
            )
        shard = head_shard(config, tp)
        self.tp = tp
        self.num_heads = shard.q_end - shard.q_start
        self.num_kv_heads = shard.kv_end - shard.kv_start
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.scale = config.head_dim**-0.5
        self.k_scale = self.v_scale = 1.0  # an FP8 KV cache's per-tensor scales (the checkpoint's, when it has them)
        self.ops = ops
        self.qkv_proj = Linear(config.hidden_size, sum(self.shard_sizes), bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.project(hidden)
        q, k = self.ops.apply_rotary(positions, q, k, cos_sin_cache)
        self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        out = self.attend(q, k_cache, v_cache, meta)
        out = self.o_proj.forward(out.reshape(num_tokens, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata):
        """Causal attention of q [T, Hq, D] over the cached keys and values (this step's written already)."""
        return self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale=self.k_scale,
                                        v_scale=self.v_scale)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the tokens, before the rotary embedding."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.forward(hidden).split(self.shard_sizes, dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        super().__init__()
        width = config.intermediate_size // (1 if tp is None else tp.size)
        self.tp = tp
        self.shard_sizes = (width, width)
        self.ops = ops
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj.forward(self.ops.silu_and_mul(self.gate_up_proj.forward(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None, index: int = 0):
        super().__init__()
        self.self_attn = self.attention_cls(config, ops, tp)
        self.mlp = self.build_mlp(config, ops, tp, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, k_cache, v_cache, meta, cos_sin_cache):
        # The residual add of the previous sub-block is fused into the next norm.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, k_cache, v_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual

    def build_mlp(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None, index: int) -> nn.Module:
        """The feed-forward block of layer `index`."""
        return LlamaMLP(config, ops, tp)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None,
                 layer_cls: type = LlamaDecoderLayer):
        super().__init__()
        rows = vocab_rows(config, tp)
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(layer_cls(config, ops, tp, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, Qwen2; subclasses swap the decoder layer (layer_cls) and the checkpoint names they fuse."""

    layer_cls = LlamaDecoderLayer
    fused_shards = _FUSED_SHARDS

    def __init__(self, config: ModelConfig, ops: SimpleNamespace, tp: TPGroup | None = None):
        """`tp`: this rank's tensor-parallel group: the model holds its shard (query and KV heads, MLP columns,
        vocabulary rows; tandem.workers.tensor_parallel), and its forward pass runs the group's collectives."""
        super().__init__()
        if tp is not None:
            check_sizes(tp.size, config.num_heads, config.num_kv_heads, config.intermediate_size)
        self.config = config
        self.ops = ops
        self.tp = tp
        self.model = LlamaModel(config, ops, tp, self.layer_cls)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, vocab_rows(config, tp), bias=False)
        )
        self.cos_sin_cache = self._build_cos_sin_cache()
        self.lm_head_packed = PackedWeight()
        self.lm_head_blocks: GGUFBlocks | None = None
        self._cache_views: tuple[torch.Tensor, list] | None = None

    def _build_cos_sin_cache(self) -> torch.Tensor:
        # A plain float32 attribute built on the CPU, not a buffer: neither model.to(dtype) nor the default
        # dtype the model is built under may round it. forward() moves it to the input's device once.
        with torch.device("cpu"):
            return self.ops.compute_cos_sin_cache(
                self.config.head_dim,
                self.config.max_position_embeddings,
                self.config.rope_theta,
                self.config.rope_scaling,
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size]. Writes this step's K/V into
        kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] at meta.slot_mapping."""
        if self.cos_sin_cache.device != input_ids.device:
            self.cos_sin_cache = self.cos_sin_cache.to(input_ids.device)
        hidden = self._embed(input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, self._layer_cache_views(kv_cache), strict=True):
            hidden, residual = layer.forward(positions, hidden, residual, k_cache, v_cache, meta, self.cos_sin_cache)
        hidden, _ = self.model.norm.forward(hidden, residual)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; with tensor parallelism each rank looks up the ids of its vocabulary rows, and
        the ranks' rows are summed."""
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        rows = self.model.embed_tokens.weight.shape[0]
        local = input_ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.model.embed_tokens.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads this rank's cache holds (all of them without tensor parallelism)."""
        shard = head_shard(self.config, self.tp)
        return shard.kv_end - shard.kv_start

    def _layer_cache_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) views of each layer's slice of kv_cache, made once per cache tensor, not per step."""
        cached = self._cache_views
        if cached is None or cached[0] is not kv_cache:
            views = [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(len(self.model.layers))]
            cached = self._cache_views = (kv_cache, views)
        return cached[1]

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding table when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def gemms(self) -> list[Gemm]:
        """Every float GEMM of a step, each once: the decoder layers' (but FP8 ones) and the LM head (read by
        compute_logits through lm_head_packed and lm_head_blocks, also when untied: the lm_head module's own forward
        is never run)."""
        layers = [Gemm(m.weight, m.bias, m.packed, m.gguf_blocks) for m in self.model.modules()
                  if isinstance(m, Linear) and not m.is_fp8]
        return [*layers, Gemm(self.head_weight, None, self.lm_head_packed, self.lm_head_blocks)]

    @property
    def gguf_block_gemms(self) -> int:
        """How many GEMMs read GGUF blocks at small batch sizes (attach_gguf_blocks)."""
        return sum(gemm.blocks is not None for gemm in self.gemms())

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden_size] -> float32 logits [B, vocab_size] (with tensor parallelism, each rank's rows of
        the vocabulary gathered on every rank)."""
        logits = linear(hidden, self.head_weight, None, self.lm_head_packed, self.lm_head_blocks).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

    def pack_weights(self) -> None:
        """Builds the packed oneDNN copies of every GEMM weight now (on CPU), rather than on first use."""
        head = self.head_weight
        probe = torch.empty(_MIN_PACKED_F32_ROWS, head.shape[1], dtype=head.dtype, device=head.device)
        if not _use_packed(probe, head):
            return
        for gemm in self.gemms():
            gemm.packed.get(gemm.weight)

    def quantize_fp8(self) -> None:
        """Holds every GEMM weight of the decoder layers in FP8 (Linear.quantize_fp8; vLLM's online `--quantization
        fp8`). The embedding and the LM head stay as they are, as vLLM keeps them."""
        for module in self.model.modules():
            if isinstance(module, Linear) and not module.is_fp8:
                module.quantize_fp8()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused) parameters; raises ValueError on unknown names, shape
        mismatches and parameters left unset."""
        params = dict(self.named_parameters())
        expected = {(name, shard) for name in params for shard in self._shard_keys(name)}
        loaded = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if (scale := kv_quant.kv_scale_name(hf_name)) is not None:
                self._set_kv_scale(hf_name, *scale, tensor)
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the head anyway, transformers ignores it too
            name, shard = self._map_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this {self.config.architecture} model")
            tensor = self._rank_slice(hf_name, tensor)
            target = params[name].data if shard is None else self._shard_target(name, shard, params[name].data)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            # A checkpoint that stores a fused tensor whole (Phi-3's qkv_proj) loads every shard at once.
            loaded.update([(name, shard)] if shard is not None else [(name, key) for key in self._shard_keys(name)])
        missing = expected - loaded
        if missing:
            names = sorted(f"{name}[{shard}]" if shard is not None else name for name, shard in missing)
            raise ValueError(f"checkpoint is missing {len(names)} tensors, e.g. {names[:5]}")

    def _set_kv_scale(self, hf_name: str, layer: int, which: str, tensor: torch.Tensor) -> None:
        """Keeps a checkpoint's FP8 KV scale on its layer's attention (used when the KV cache is FP8)."""
        if layer >= len(self.model.layers):
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this {self.config.architecture} model")
        attn = self.model.layers[layer].self_attn
        value = kv_quant.scale_value(hf_name, tensor)
        if "k" in which:
            attn.k_scale = value
        if "v" in which:
            attn.v_scale = value

    def kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's (k_scale, v_scale) for an FP8 KV cache."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.model.layers]

    def _shard_keys(self, name: str) -> list:
        """The checkpoint tensors parameter `name` is loaded from, by shard key ([None]: one tensor, whole)."""
        owner = self._fused_owner(name)
        return [None] if owner is None else list(range(len(owner.shard_sizes)))

    def _shard_target(self, name: str, shard, data: torch.Tensor) -> torch.Tensor:
        """The part of parameter `name` (its data) that shard `shard` of the checkpoint fills."""
        sizes = self._fused_owner(name).shard_sizes
        return data.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _rank_slice(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (the whole tensor without tensor parallelism): column-parallel
        q/k/v and gate/up by output rows, row-parallel o and down by input columns, the embedding and the LM head by
        vocabulary rows (the last rank's padded with zeros); norms whole."""
        tp = self.tp
        if tp is None:
            return tensor
        config = self.config
        module, _, kind = hf_name.rpartition(".")
        leaf = module.rpartition(".")[2]
        heads, d = head_shard(config, tp), config.head_dim
        width = config.intermediate_size // tp.size
        rows_by_module = {"q_proj": (heads.q_start * d, heads.q_end * d), "k_proj": (heads.kv_start * d, heads.kv_end * d),
                          "v_proj": (heads.kv_start * d, heads.kv_end * d),
                          "gate_proj": (tp.rank * width, (tp.rank + 1) * width),
                          "up_proj": (tp.rank * width, (tp.rank + 1) * width)}
        if leaf in rows_by_module:
            start, end = rows_by_module[leaf]
            return tensor[start:end]
        if leaf in ("o_proj", "down_proj") and kind == "weight":
            start, end = (heads.q_start * d, heads.q_end * d) if leaf == "o_proj" else \
                (tp.rank * width, (tp.rank + 1) * width)
            return tensor[:, start:end]
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = vocab_rows(config, tp)
            part = tensor[tp.rank * rows:(tp.rank + 1) * rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            return part
        return tensor

    def attach_gguf_blocks(self, blocks: Iterable[tuple[str, GGUFBlocks]]) -> None:
        """Gives each GEMM whose whole weight the file stores in GGUF blocks (every shard of a fused one, all in
        one type) those blocks, for linear() to read at small batch sizes (gguf_block_gemms counts them).
        The weights must be loaded already: the blocks serve alongside them, not instead."""
        head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        shards: dict[str, dict[int | None, GGUFBlocks]] = {}
        for hf_name, block_rows in blocks:
            if hf_name == head:
                self.lm_head_blocks = block_rows
                continue
            name, shard = self._map_name(hf_name)
            if name.endswith(".weight") and isinstance(self._owner(name), Linear):
                shards.setdefault(name, {})[shard] = block_rows
        for name, parts in shards.items():
            owner = self._fused_owner(name)
            order = [None] if owner is None else list(range(len(owner.shard_sizes)))
            if set(parts) != set(order) or len({parts[i].ggml_type for i in order}) != 1:
                continue  # a shard in another type (or dequantized-only): this GEMM keeps the float path
            data = torch.cat([parts[i].data for i in order]) if len(order) > 1 else parts[order[0]].data
            linear_module = self._owner(name)
            if data.shape[0] != linear_module.weight.shape[0]:
                raise ValueError(f"GGUF blocks of {name!r} have {data.shape[0]} rows, the weight has "
                                 f"{linear_module.weight.shape[0]}")
            linear_module.gguf_blocks = GGUFBlocks(parts[order[0]].ggml_type, data)

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rpartition(".")[0])

    def _fused_owner(self, param_name: str) -> nn.Module | None:
        """The attention or MLP module whose fused projection holds param_name, or None."""
        parts = param_name.split(".")
        if len(parts) < 3 or parts[-2] not in ("qkv_proj", "gate_up_proj"):
            return None
        return self.get_submodule(".".join(parts[:-2]))

    def _map_name(self, hf_name: str) -> tuple[str, int | None]:
        for hf_part, (ours, shard) in self.fused_shards.items():
            if f".{hf_part}." in hf_name:
                return hf_name.replace(hf_part, ours), shard
        return hf_name, None
