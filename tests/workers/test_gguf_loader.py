"""GGUF reading: dequantization of every supported type, name mapping, Q/K un-permutation, rope scaling.

Tiny GGUF files are written with gguf.GGUFWriter. Quantizable types are produced with gguf.quants.quantize
and checked both against gguf.quants.dequantize and against the original floats (within one quantization
step); for the K-quants, which the package cannot quantize, raw blocks are built from random bytes with
sane fp16 scales and checked against a numpy transcription of ggml's C dequantize_row_q4_K / q6_K.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.gguf_file import open_gguf
from tandem.model_source import resolve_model_source
from tandem.workers.models.gguf_loader import dequantize_tensor, gguf_to_hf_name, unpermute_rotary_rows
from tandem.workers.models.loader import load_model

QK_K = 256


def _write_gguf(path, arch: str, tensors: dict, metadata=None) -> str:
    """tensors: name -> (array, raw_dtype or None). metadata: callable(writer) adding key/values."""
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(writer)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _read_all(path) -> dict[str, np.ndarray]:
    return {t.name: dequantize_tensor(t) for t in open_gguf(path).tensors}


# -- independent references for the K-quants (ggml-quants.c) ----------------------------------------------


def _scale_min_k4(j: int, scales: np.ndarray) -> tuple[int, int]:  # ggml's get_scale_min_k4
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)


def _reference_q4_k(blocks: np.ndarray) -> np.ndarray:
    out = []
    for block in blocks:
        d = np.float32(block[0:2].view(np.float16)[0])
        dmin = np.float32(block[2:4].view(np.float16)[0])
        scales = block[4:16].astype(np.int32)
        qs = block[16:144]
        y = np.empty(QK_K, np.float32)
        for chunk in range(4):
            q = qs[32 * chunk : 32 * chunk + 32]
            sc1, m1 = _scale_min_k4(2 * chunk, scales)
            sc2, m2 = _scale_min_k4(2 * chunk + 1, scales)
            y[64 * chunk : 64 * chunk + 32] = (d * np.float32(sc1)) * (q & 0xF).astype(np.float32) - dmin * np.float32(m1)
            y[64 * chunk + 32 : 64 * chunk + 64] = (d * np.float32(sc2)) * (q >> 4).astype(np.float32) - dmin * np.float32(m2)
        out.append(y)
    return np.stack(out)


def _reference_q6_k(blocks: np.ndarray) -> np.ndarray:
    out = []
    for block in blocks:
        ql, qh = block[0:128].astype(np.int32), block[128:192].astype(np.int32)
        scales = block[192:208].view(np.int8).astype(np.float32)
        d = np.float32(block[208:210].view(np.float16)[0])
        y = np.empty(QK_K, np.float32)
        for half in range(2):
            low, high, sc = ql[64 * half : 64 * half + 64], qh[32 * half : 32 * half + 32], scales[8 * half : 8 * half + 8]
            is_ = np.arange(32) // 16
            q1 = ((low[:32] & 0xF) | (((high >> 0) & 3) << 4)) - 32
            q2 = ((low[32:] & 0xF) | (((high >> 2) & 3) << 4)) - 32
            q3 = ((low[:32] >> 4) | (((high >> 4) & 3) << 4)) - 32
            q4 = ((low[32:] >> 4) | (((high >> 6) & 3) << 4)) - 32
            base = 128 * half
            for offset, q, sc_shift in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                y[base + offset : base + offset + 32] = (d * sc[is_ + sc_shift]) * q.astype(np.float32)
        out.append(y)
    return np.stack(out)


def _random_k_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Raw bytes [rows, cols/256 * type_size] of valid K-quant blocks: random payload, fp16 scales in a sane
    range (random bytes there could be inf/nan)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.05, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:4] = scale  # d, dmin
    else:
        raw[:, 208:210] = scale[:, :2]  # d
    return raw.reshape(rows, -1)


def test_every_supported_type_dequantizes_correctly(tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    original = rng.standard_normal((rows, cols)).astype(np.float32)
    quantized = {qtype: gguf.quants.quantize(original, qtype) for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1)}
    k_blocks = {qtype: _random_k_blocks(rng, qtype, rows, cols) for qtype in (Q.Q4_K, Q.Q6_K)}
    tensors = {
        "f32": (original, None),
        "f16": (original.astype(np.float16), None),
        **{qtype.name: (data, qtype) for qtype, data in {**quantized, **k_blocks}.items()},
    }
    got = _read_all(_write_gguf(tmp_path / "types.gguf", "llama", tensors))
    assert all(array.shape == (rows, cols) and array.dtype == np.float32 for array in got.values())

    assert np.array_equal(got["f32"], original)
    assert np.array_equal(got["f16"], original.astype(np.float16).astype(np.float32))

    # Block-wise bound on the rounding error: one quantization step of the block.
    block_amax = np.abs(original).reshape(-1, 32).max(axis=1, keepdims=True)
    block_range = np.ptp(original.reshape(-1, 32), axis=1, keepdims=True)
    steps = {Q.Q8_0: block_amax / 127, Q.Q4_0: block_amax / 8, Q.Q4_1: block_range / 15}
    for qtype, data in quantized.items():
        assert np.array_equal(got[qtype.name], gguf.quants.dequantize(data, qtype))
        error = np.abs(got[qtype.name] - original).reshape(-1, 32)
        assert (error <= steps[qtype] * 1.01).all(), qtype.name

    for qtype, reference in ((Q.Q4_K, _reference_q4_k), (Q.Q6_K, _reference_q6_k)):
        blocks = k_blocks[qtype].reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
        expected = reference(blocks).reshape(rows, cols)
        np.testing.assert_allclose(got[qtype.name], expected, rtol=1e-6, atol=1e-6)
        assert np.abs(expected).max() > 0.1  # the random blocks decode to something non-trivial


def test_unsupported_type_is_refused_by_name(tmp_path):
    data = gguf.quants.quantize(np.ones((2, 32), np.float32), Q.Q5_0)
    path = _write_gguf(tmp_path / "q5.gguf", "llama", {"blk.0.attn_q.weight": (data, Q.Q5_0)})
    with pytest.raises(ValueError, match=r"Q5_0.*supported: .*Q4_K"):
        _read_all(path)


def test_names_map_to_hf_and_unknown_names_are_refused():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute (n_head already the KV head count for k_proj)
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, 3), 3), weight)
    bias = np.arange(24, dtype=np.float32)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(bias, 3), 3), bias)
    assert not np.array_equal(_llama_cpp_permute(weight, 3), weight)


def _hf_to_gguf(hf_model, path, arch: str, quantize_as=lambda hf_name: None) -> str:
    """Writes an HF Llama/Qwen2 model the way convert_hf_to_gguf.py does (F32, Q/K permuted for llama,
    no output.weight when tied, llama3 rope scaling as the rope_freqs tensor); quantize_as(hf_name) may name
    a type a tensor is quantized to instead."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, 99)
    tensors = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        qtype = quantize_as(hf_name)
        if qtype is not None:
            array = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = (np.ascontiguousarray(array), qtype)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
        default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
        tensors["rope_freqs.weight"] = ((default / scaled).numpy(), None)

    def metadata(writer):
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_eos_token_id(2)

    return _write_gguf(path, arch, tensors, metadata)


@pytest.mark.parametrize("fixture, arch", [("tiny_llama_dir", "llama"), ("tiny_qwen2_dir", "qwen2")])
def test_gguf_conversion_of_tiny_models_matches_transformers(fixture, arch, request, tmp_path, paged_greedy):
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    loaded = load_model(_hf_to_gguf(hf_model, tmp_path / f"tiny-{arch}.gguf", arch))
    assert loaded.tokenizer is None and loaded.config.name == f"tiny-{arch}"
    config = loaded.config
    assert config.architecture == arch and config.num_kv_heads == 2 and config.eos_token_ids == [2]
    assert config.tie_word_embeddings == (arch == "qwen2") and config.attention_bias == (arch == "qwen2")
    assert (config.rope_scaling or {}).get("rope_type") == ("freq_factors" if arch == "llama" else None)

    prompt = [17, 4000, 123, 9, 30000, 77, 5]
    tokens, step_logits = paged_greedy(loaded.model, prompt, 12, stop_ids=config.eos_token_ids)
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 7:].tolist()
        reference = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    assert tokens == expected
    torch.testing.assert_close(torch.stack(step_logits), reference[: len(step_logits)], rtol=0, atol=1e-4)


def _mixed_quantization(hf_name: str):
    """GEMM weights in the three types the CPU GEMV reads; layer 0's k_proj in another type than its q and v,
    so its fused qkv GEMM cannot take blocks."""
    if hf_name.endswith("norm.weight") or hf_name.endswith(".bias"):
        return None
    if "layers.0.self_attn.k_proj" in hf_name:
        return Q.Q8_0
    if "self_attn." in hf_name:
        return Q.Q4_0
    return Q.Q4_1 if ".mlp." in hf_name else Q.Q8_0  # the rest: embedding and LM head


@pytest.mark.parametrize("fixture, arch", [("tiny_llama_dir", "llama"), ("tiny_qwen2_dir", "qwen2")])
def test_quantized_gguf_serves_from_its_blocks_as_from_its_dequantized_weights(fixture, arch, request, tmp_path,
                                                                                paged_greedy):
    """Decode GEMMs read the file's blocks (quantized_gemv "auto", kernels/gguf_linear.py): rows un-permuted
    like the dequantized weights', fused shards concatenated, and the same greedy tokens and logits."""
    from tandem.workers.kernels import gguf_linear

    transformers = pytest.importorskip("transformers")
    if not gguf_linear.supported():
        pytest.skip("no GGUF GEMV kernel on this machine (no compiler or no AVX-512)")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    path = _hf_to_gguf(hf_model, tmp_path / f"tiny-{arch}-q.gguf", arch, _mixed_quantization)
    blocks, floats = load_model(path), load_model(path, quantized_gemv="off")
    layers = blocks.config.num_layers
    # Per layer qkv, o, gate_up and down, less layer 0's mixed qkv; plus the LM head (tied: the embedding).
    assert blocks.gguf_block_gemms == 4 * layers - 1 + 1 and floats.gguf_block_gemms == 0
    assert blocks.model.model.layers[0].self_attn.qkv_proj.gguf_blocks is None
    assert blocks.model.model.layers[1].self_attn.qkv_proj.gguf_blocks.ggml_type == Q.Q4_0
    assert blocks.model.lm_head_blocks.ggml_type == Q.Q8_0

    prompt = [17, 4000, 123, 9, 30000, 77, 5]
    tokens, step_logits = paged_greedy(blocks.model, prompt, 12, stop_ids=[])
    expected_tokens, expected_logits = paged_greedy(floats.model, prompt, 12, stop_ids=[])
    assert tokens == expected_tokens
    torch.testing.assert_close(torch.stack(step_logits), torch.stack(expected_logits), rtol=0, atol=1e-4)


def test_the_reader_reads_what_ggufs_own_reader_reads_from_plain_views():
    """tandem.gguf_file opens files with gguf's reader over a plain ndarray view of the map: the same fields and
    tensors, none of them np.memmap (whose per-slice Python bookkeeping made half of a worker's start-up)."""
    path = resolve_model_source("smollm2")
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(a.data, b.data) and a.tensor_type == b.tensor_type, a.name
    arrays = [t.data for t in ours.tensors] + [p for f in ours.fields.values() for p in f.parts]
    assert not any(isinstance(a, np.memmap) for a in arrays)


def test_a_missing_or_foreign_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_gguf(str(tmp_path / "absent.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        open_gguf(str(tmp_path / "text.gguf"))
