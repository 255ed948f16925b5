"""--kv-cache-dtype fp8 in the engine: what it allocates, the checkpoint's scales, the layout fingerprint, and P/D
between two FP8 workers (token-exact against a colocated FP8 engine, moving one byte per element)."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file
from test_engine_pd import run

from tandem.config import EngineConfig
from tandem.errors import APIError
from tandem.metrics import EngineMetrics
from tandem.protocol import DecodeRequest, KVHandle, SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine, RemoteKV
from tandem.workers.engine.model_runner import ModelRunner, kv_block_bytes
from tandem.workers.internal_api import check_handle
from tandem.workers.kv_transfer import create_kv_transfer
from tandem.workers.layers.kv_quant import FP8_KV
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def fake_loaded(dtype: torch.dtype):
    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2,
                         num_heads=2, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256)
    return types.SimpleNamespace(model=None, config=config, tokenizer=None, dtype=dtype, device=torch.device("cpu"))


def test_fp8_doubles_the_blocks_that_fit_in_the_memory_given():
    gb = kv_block_bytes(2, 16, 2, 8, torch.bfloat16) * 100 / (1 << 30)  # 100 bf16 blocks
    bf16 = ModelRunner(fake_loaded(torch.bfloat16), EngineConfig(kv_cache_memory_gb=gb))
    fp8 = ModelRunner(fake_loaded(torch.bfloat16), EngineConfig(kv_cache_memory_gb=gb, kv_cache_dtype="fp8"))
    fp8_e4m3 = ModelRunner(fake_loaded(torch.float32), EngineConfig(kv_cache_memory_gb=gb, kv_cache_dtype="fp8_e4m3"))
    assert (bf16.num_blocks, fp8.num_blocks, fp8_e4m3.num_blocks) == (100, 200, 200)
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == fp8_e4m3.kv_cache.dtype == FP8_KV
    assert fp8.kv_cache.nbytes == bf16.kv_cache.nbytes  # the same memory, twice the blocks
    auto = ModelRunner(fake_loaded(torch.float32), EngineConfig(num_kv_blocks=3, kv_cache_dtype="auto"))
    assert auto.kv_cache.dtype == torch.float32


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValidationError, match="'auto', 'fp8' or 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_cli_refuses_an_unknown_kv_cache_dtype_in_one_line(capsys):
    from tandem.cli import main

    with pytest.raises(SystemExit):
        main(["worker", "--kv-cache-dtype", "fp4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-cache-dtype" in err and "'auto', 'fp8', 'fp8_e4m3'" in err, err


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype="float32")


def engine(loaded, role: str, kv_cache_dtype: str = "fp8", **overrides) -> LLMEngine:
    settings = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=8,
                    kv_pull_in_background="on", kv_cache_dtype=kv_cache_dtype)
    settings.update(overrides)
    return LLMEngine(loaded, EngineConfig(**settings), EngineMetrics(loaded.config.name, role))


def test_the_layout_fingerprint_carries_the_kv_dtype_and_a_mixed_pair_is_refused(tiny):
    fp8, auto = engine(tiny, "prefill"), engine(tiny, "decode", kv_cache_dtype="auto")
    assert fp8.layout.dtype == "float8_e4m3fn" and auto.layout.dtype == "float32"
    assert fp8.layout.mismatches(auto.layout) == ["dtype: handle 'float8_e4m3fn', this worker 'float32'"]
    handle = KVHandle(source_url="http://p", agent_name="p", lease_id="l", block_ids=[0], num_tokens=3,
                      layout=fp8.layout, expires_at=0.0)
    body = DecodeRequest(request_id="r", prompt_token_ids=[5, 6, 7], first_token_id=8, kv_handle=handle,
                         sampling=GREEDY)
    # The decode worker's refusal, whose code makes the router compute the prompt on the decode pool instead.
    with pytest.raises(APIError) as refused:
        check_handle(types.SimpleNamespace(layout=auto.layout), body, handle)
    assert refused.value.code == "kv_layout_mismatch" and "dtype" in refused.value.message
    check_handle(types.SimpleNamespace(layout=engine(tiny, "decode").layout), body, handle)  # fp8 to fp8: taken


@pytest.mark.parametrize("length", [1, 16, 17, 100])
def test_pd_between_fp8_workers_is_token_exact_and_moves_fp8_bytes(tiny, length):
    prefill, decode, colocated = engine(tiny, "prefill"), engine(tiny, "decode"), engine(tiny, "both")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, f"p-fp8-{length}")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, f"d-fp8-{length}")
    moved = []
    read = decode.kv_transfer.read_blocks
    decode.kv_transfer.read_blocks = lambda *a, **k: moved.append(read(*a, **k)) or moved[-1]
    try:
        prompt = [(37 * i + length) % 900 + 5 for i in range(length)]
        reference, _ = run(colocated, "c", prompt, GREEDY)
        first, outs = run(prefill, "r", prompt, GREEDY, prefill_only=True)
        lease = outs[-1].kv_lease
        source = RemoteKV(prefill.kv_transfer.agent_info(), lease.block_ids, lease.expires_at)
        rest, outs = run(decode, "r", prompt, GREEDY, first_token_id=first[0], kv_source=source)
        prefill.release_lease(lease.lease_id)
        assert outs[0].kv_status == "pulled" and first + rest == reference
        config = tiny.config
        block_bytes = kv_block_bytes(config.num_layers, 16, config.num_kv_heads, config.head_dim, FP8_KV)
        assert block_bytes * 4 == kv_block_bytes(config.num_layers, 16, config.num_kv_heads, config.head_dim,
                                                 torch.float32)
        assert decode.kv_transfer.block_bytes == block_bytes and moved == [len(lease.block_ids) * block_bytes]
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


@pytest.fixture(scope="module")
def scaled_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with compressed-tensors style KV scales in a shard of their own (layer 0: k 0.5, v 0.25;
    layer 1: the deprecated single kv_scale, 2.0)."""
    folder = str(tmp_path_factory.mktemp("scaled"))
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale":
              torch.tensor([0.25]), "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)}
    save_file(scales, os.path.join(folder, "kv-scales.safetensors"))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(scales, "kv-scales.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)
    return folder


def test_the_checkpoints_kv_scales_are_used(scaled_dir, tiny):
    scaled = load_model(scaled_dir, dtype="float32")
    assert scaled.model.kv_scales() == [(0.5, 0.25), (2.0, 2.0)]
    assert tiny.model.kv_scales() == [(1.0, 1.0), (1.0, 1.0)]  # none in the checkpoint: vLLM's default
    eng = engine(scaled, "both")
    tokens, _ = run(eng, "s", list(range(5, 45)), GREEDY)
    assert len(tokens) == GREEDY.max_tokens
    # What the cache holds is each key / its layer's k_scale: layer 1's is half of the unscaled engine's.
    eng, plain = engine(scaled, "both"), engine(tiny, "both")
    for each in (eng, plain):  # the prompt's KV only
        run(each, "p", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=1))
    stored, unscaled = eng.runner.kv_cache[:, 1, 0].float(), plain.runner.kv_cache[:, 1, 0].float()
    torch.testing.assert_close(stored.abs().sum(), unscaled.abs().sum() / 2, rtol=0.05, atol=0)


def test_a_per_head_kv_scale_is_refused(scaled_dir, tmp_path):
    folder = str(tmp_path / "per_head")
    shutil.copytree(scaled_dir, folder)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale":
               torch.tensor([0.25]), "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)},
              os.path.join(folder, "kv-scales.safetensors"))
    with pytest.raises(ValueError, match="only per-tensor scales are supported"):
        load_model(folder, dtype="float32")
