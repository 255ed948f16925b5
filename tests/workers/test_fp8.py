"""FP8 weights (`--quantization fp8`): the CPU reference arithmetic, what an engine serves with it, and its quality
against the float model, within bounds stated before measuring.

The bounds. e4m3 keeps 3 mantissa bits: a weight or activation rounds by at most 1/16 of its value, each output
channel and each token scaled to its own largest magnitude; a 135M model with activation outliers moves more under
FP8 than the large models of published FP8 runs. Held here:
- SmolLM2-135M (its Q4_1 GGUF dequantized, then FP8), 330 tokens of fixed prose, teacher-forced: perplexity within
  +3% of float (the issue's bound), the float model's top-1 token kept at >= 85% of positions, mean KL(float || fp8)
  <= 0.05 nats per token.
- A tiny random Llama: its FP8 engine token-exact against the same FP8 model run without the engine; its logits
  within 50% of the float model's norm (its own gain amplifies FP8's weight error: see that test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.layers.fp8_linear import FP8, fp8_linear, quantize_rows_reference, quantize_weight
from tandem.workers.models.llama import Linear
from tandem.workers.models.loader import load_model

PROSE = (
    "The river ran low that summer, and the children of the village walked along its bed where the water had been. "
    "They found smooth stones, the bones of a small bird, and a rusted key that no one could match to any door. "
    "Their grandmother said the key belonged to the mill, which had burned down long before any of them were born. "
    "She told them how the miller had kept his flour in great wooden bins, and how the whole valley came to him after "
    "the harvest. In the evenings the old men sat outside the inn and argued about the weather, the price of wheat, "
    "and whether the new road would bring trade or only dust. The schoolteacher, who had come from the city, wrote "
    "down their stories in a thick notebook. She believed that a place is made of the things people remember about "
    "it, and that when the last person who remembers is gone, the place becomes something else. When autumn came the "
    "rains returned, the river rose again, and the stones the children had gathered were covered once more. But the "
    "key stayed on a nail above the kitchen door, and every visitor asked about it, and every time the grandmother "
    "told the story a little differently. Years later, when the children had grown and moved away, one of them found "
    "the teacher's notebook in a shop that sold old books. Inside, between a recipe for plum jam and a list of birds "
    "seen in March, was a drawing of the mill with a small door at the back, and next to it, in careful handwriting, "
    "the words: the key is kept by the family who lives closest to the water."
)


def test_the_reference_is_w8a8_with_per_token_and_per_channel_scales():
    generator = torch.Generator().manual_seed(0)
    weight, x, bias = torch.randn(48, 64, generator=generator), torch.randn(5, 64, generator=generator), torch.randn(48)
    q, scales = quantize_weight(weight)
    assert q.dtype == FP8 and scales.shape == (48,)
    qx, x_scales = quantize_rows_reference(x)
    expected = (qx.float() * x_scales) @ (q.float() * scales[:, None]).T + bias
    torch.testing.assert_close(fp8_linear(x, q, scales, bias), expected, rtol=1e-5, atol=1e-5)
    # Within FP8's rounding of the float product: each factor off by up to 1/16.
    error = (fp8_linear(x, q, scales) - x @ weight.T).norm() / (x @ weight.T).norm()
    assert error <= 0.05, error


@pytest.fixture(scope="module")
def teacher_forced_logits(attention_metadata):
    """logits(model, ids): each position's float32 logits, the whole prompt in one pass on a fresh paged cache."""

    def logits(model, ids: list[int]) -> torch.Tensor:
        blocks = -(-len(ids) // 16)
        positions, meta = attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], 16)
        config = model.config
        cache = torch.zeros(blocks, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim,
                            dtype=model.head_weight.dtype)
        return model.compute_logits(model.forward(torch.tensor(ids), positions, cache, meta))

    return logits


def text_quality(reference: torch.Tensor, logits: torch.Tensor, ids: list[int], label: str) -> tuple[float, ...]:
    """Teacher-forced `logits` against the float `reference` on `ids`: (perplexity of each, mean KL in nats, share
    of positions whose top-1 token is kept), printed under `label`."""
    targets = torch.tensor(ids[1:])
    ppl = torch.exp(F.cross_entropy(reference[:-1], targets)).item()
    ppl_q = torch.exp(F.cross_entropy(logits[:-1], targets)).item()
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    kept = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    print(f"{label}: ppl {ppl:.3f} -> {ppl_q:.3f} ({100 * (ppl_q / ppl - 1):+.2f}%), top-1 kept {100 * kept:.1f}%, "
          f"KL {kl:.4f}")
    return ppl, ppl_q, kl, kept


def test_smollm2_in_fp8_stays_within_the_stated_bounds(smollm2_gguf_path, smollm2, teacher_forced_logits):
    ids = smollm2.tokenizer.encode(PROSE, False)
    assert len(ids) > 300
    reference = teacher_forced_logits(smollm2.model, ids)
    quantized = load_model(smollm2_gguf_path, dtype="float32", backend="torch", quantized_gemv="off")
    quantized.model.quantize_fp8()  # the loader refuses --quantization on a GGUF file: done by hand here
    logits = teacher_forced_logits(quantized.model, ids)
    ppl, ppl_fp8, kl, kept = text_quality(reference, logits, ids, "SmolLM2 prose, FP8 weights")
    assert ppl_fp8 <= 1.03 * ppl, (ppl, ppl_fp8)
    assert kept >= 0.85 and kl <= 0.05, (kept, kl)


def test_an_engine_serves_a_float_checkpoint_in_fp8(tiny_llama_dir, paged_greedy, teacher_forced_logits):
    """The engine's FP8 tokens equal the same FP8 model's greedy tokens without the engine (with chunked prefill,
    a batch of two, and a prefix-cache hit), and its logits stay near the float model's. The tiny model's GEMMs each
    amplify (weights of std 0.2, width 64): the error FP8 puts in each weight grows to a large share of the logits'
    norm, so that bound (50%) only catches a wrong scale, which puts the logits off by their whole norm or more."""
    config = EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, quantization="fp8", max_num_batched_tokens=16)
    engine = LLMEngine.from_config(config)
    model = engine.runner.model
    layers = [m for m in model.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.is_fp8 and m.weight_scale.shape == (m.weight.shape[0],) for m in layers)
    assert model.head_weight.dtype == torch.float32  # the embedding and the LM head stay float
    prompts = [[5, 9, 13, 200, 7, 7, 31] * 5, [5, 9, 13, 200, 7, 7, 31] * 5 + list(range(1000, 1020))]
    expected = [paged_greedy(model, p, 12)[0] for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert engine.block_manager.num_hit_tokens > 0  # the second prompt found the first one's blocks
    reference = load_model(tiny_llama_dir, backend="torch").model
    ids = prompts[1]
    drift = (teacher_forced_logits(model, ids) - teacher_forced_logits(reference, ids)).norm(dim=-1)
    assert (drift / teacher_forced_logits(reference, ids).norm(dim=-1)).max() <= 0.5


def test_fp8_is_refused_for_a_gguf_file_in_one_line(smollm2_gguf_path):
    with pytest.raises(ValueError, match="GGUF file, whose weights are quantized already"):
        load_model(smollm2_gguf_path, quantization="fp8")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_model(smollm2_gguf_path, quantization="int3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_the_gpu_paths_match_their_references(rows, monkeypatch):
    """_scaled_mm (where the GPU has FP8 tensor cores) against the W8A8 reference, and the weight-only Triton GEMM
    against x times the dequantized weight; bf16 activations and outputs: within bf16's rounding of the output (the
    sums run in float32 on both, in other orders)."""
    from tandem.workers.layers import fp8_linear as module

    generator = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(4096, 4096, generator=generator) * 0.02, torch.randn(rows, 4096, generator=generator)
    q, scales = quantize_weight(weight)
    x = x.to(torch.bfloat16)
    w8a8 = fp8_linear(x.float(), q, scales)
    w8a16 = x.float() @ (q.float() * scales[:, None]).T
    for weight_only_rows in (0, 1000):
        monkeypatch.setattr(module, "WEIGHT_ONLY_MAX_ROWS", weight_only_rows)
        out = fp8_linear(x.cuda(), q.cuda(), scales.cuda()).float().cpu()
        expected = w8a8 if module.scaled_mm_supported(torch.device("cuda")) and not weight_only_rows else w8a16
        torch.testing.assert_close(out, expected, rtol=0.02, atol=0.01 * float(expected.abs().max()))
