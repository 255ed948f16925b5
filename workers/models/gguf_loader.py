"""Reads a llama.cpp GGUF file: metadata -> ModelConfig, and its tensors dequantized under HF names.

llama.cpp's converter stores the Llama Q and K projections with the rows of each head interleaved for its
rotary layout (`permute` in convert_hf_to_gguf.py); the HF-style rotary this engine uses needs the original
order back, so those rows are un-permuted here. Qwen2 files are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from tandem.workers.kernels.gguf_linear import BLOCK_TYPES, GGUFBlocks
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.registry import family_for_gguf

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    }
)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1 files carry the llama3 rope scaling as this tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


def metadata_value(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor dequantized to float32, in numpy (row-major, HF) shape."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, which this loader does not support "
            f"(supported: {supported})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
    factors = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if kind == "linear":
        if factors is not None:
            raise ValueError("GGUF has both linear rope scaling and rope_freqs; not supported")
        return {"rope_type": "linear", "factor": float(metadata_value(reader, f"{arch}.rope.scaling.factor"))}
    if kind != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: none, linear, rope_freqs)")
    if factors is not None:
        return {"rope_type": "freq_factors", "freq_factors": dequantize_tensor(factors).tolist()}
    return None


def _eos_ids(reader: GGUFReader) -> list[int]:
    # llama.cpp stops on every end-of-generation token the file names, not only eos.
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata_value(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def load_gguf_config(reader: GGUFReader, name: str = "model") -> ModelConfig:
    arch = metadata_value(reader, "general.architecture")
    family = family_for_gguf(arch)

    def required(key: str):
        value = metadata_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"GGUF {arch}.{key} varies per layer; not supported")
        return value

    tensor_names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = metadata_value(reader, f"{arch}.attention.head_count_kv", num_heads)
    head_dim = int(metadata_value(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = metadata_value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"GGUF rotates {rotary_dim} of {head_dim} head dims; partial rotary is not supported")
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(embedding.shape[1]),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(required("context_length")),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(reader),
        name=name,
    )


def gguf_to_hf_name(name: str) -> str:
    stem, dot, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a llama/qwen2 model")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute` (which turns HF's half-split rotary layout into llama.cpp's
    interleaved one) for a Q or K weight or bias with num_heads heads along dim 0."""
    head_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unpermute_for(hf_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """The tensor's rows back in HF order where llama.cpp's converter permuted them (Llama Q and K)."""
    if config.architecture == "llama":
        for part, heads in (("self_attn.q_proj", config.num_heads), ("self_attn.k_proj", config.num_kv_heads)):
            if f".{part}." in hf_name:
                return unpermute_rotary_rows(array, heads)
    return array


def iter_gguf_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, float32 tensor) for every weight of the file, dequantized and un-permuted."""
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        hf_name = gguf_to_hf_name(tensor.name)
        array = _unpermute_for(hf_name, dequantize_tensor(tensor), config)
        if not array.flags.writeable:  # unquantized float32 tensors are views of the read-only file mapping
            array = array.copy()
        yield hf_name, torch.from_numpy(array)


def iter_gguf_blocks(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, GGUFBlocks]]:
    """(HF parameter name, the file's quantized blocks, rows un-permuted) for every 2-D weight stored in a
    type the CPU GEMV kernel reads (kernels/gguf_linear.py)."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in BLOCK_TYPES or len(tensor.shape) != 2 or tensor.name == _ROPE_FREQS:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        rows = int(tensor.shape[1])  # GGUF lists dimensions innermost first
        array = _unpermute_for(hf_name, np.asarray(tensor.data).reshape(rows, -1), config)
        yield hf_name, GGUFBlocks(tensor.tensor_type, torch.from_numpy(np.array(array)))  # a copy off the mapping
