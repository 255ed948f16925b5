"""The whole engine on the Triton attention backend: greedy tokens equal HF transformers and the torch backend.

One scenario, on a random Llama-3-style checkpoint (GQA 4:1, llama3 rope scaling) written with transformers:
a first wave of concurrent requests (one prompt longer than the step budget, so it is prefilled in chunks
while the others decode beside it; lengths 1, one block and one past a block), then a second wave whose
prompt starts with the first prompt's leading blocks (a prefix-cache hit).

- On any machine: the Triton kernels run in Triton's CPU interpreter, float32. That needs TRITON_INTERPRET=1
  before the kernels are imported, and an interpreted kernel module would stay interpreted for the rest of
  the process, so the Triton engine runs in a subprocess (this file run as a script) with the variable set;
  it never leaks into other tests. HF and the torch backend run in the test process.
- @gpu (skipped without CUDA): the same scenario in this process with compiled kernels, on a larger model
  (head dim 128) in float32; and bf16 logits at the last prompt position against HF's bf16 logits.

    PYTHONSAFEPATH=1 .venv/bin/pytest -q tests/workers/test_engine_triton.py
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.cuda_graphs import DecodeGraphs
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.models.loader import load_model

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # llama3 scaling bands are set by wavelengths relative to this; it is chosen so that with rope_theta
    # 500000 some frequencies are kept, some smoothed and some divided by the factor.
    original_max_position_embeddings: int
    initializer_range: float


@dataclass(frozen=True)
class Scenario:
    shape: ModelShape
    prompt_lens: tuple[int, ...]  # the first wave, submitted together
    max_tokens: int
    max_num_batched_tokens: int  # smaller than the longest prompt: that one is prefilled in chunks
    shared_prefix_blocks: int  # the second wave's prompt reuses this many blocks of the first prompt
    block_size: int = 16
    seed: int = 0

    def prompts(self) -> tuple[list[list[int]], list[int]]:
        """(first-wave prompts, second-wave prompt): random ids, the second sharing the first's prefix."""
        rng = random.Random(self.seed)
        draw = lambda n: [rng.randrange(3, self.shape.vocab_size) for _ in range(n)]  # noqa: E731
        wave1 = [draw(n) for n in self.prompt_lens]
        wave2 = wave1[0][: self.shared_prefix_blocks * self.block_size] + draw(7)
        return wave1, wave2


# Interpreter-sized: every kernel program runs as numpy on the CPU, so it stays tiny (about 10 s of CPU time).
CPU_SCENARIO = Scenario(
    ModelShape(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=16, original_max_position_embeddings=256, initializer_range=0.2),
    prompt_lens=(50, 1, 16, 17, 9), max_tokens=6, max_num_batched_tokens=24, shared_prefix_blocks=2,
)
# GPU-sized: Llama-3's head dim and GQA ratio, prompts that span prefill tiles and many KV blocks.
GPU_SCENARIO = Scenario(
    ModelShape(vocab_size=8192, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, original_max_position_embeddings=1024, initializer_range=0.02),
    prompt_lens=(700, 1, 16, 17, 333, 129), max_tokens=16, max_num_batched_tokens=256, shared_prefix_blocks=20,
)
SCENARIOS = {"interpreter": CPU_SCENARIO, "cuda": GPU_SCENARIO}

# bf16 logits (GPU_SCENARIO's model, whose logits have std ~0.65 and |max| ~2.6): ours may differ from HF's
# bf16 logits by at most BF16_MAX_ABS anywhere (8 bf16 steps at magnitude 2-4) and BF16_MEAN_ABS on average,
# and may be no further from HF's float32 logits than twice HF's own bf16 error plus one bf16 step.
# (Measured on a CPU with the torch backend, same model and prompts: max 0.035, mean 0.007; HF bf16 vs float32
# 0.031-0.043.)
BF16_MAX_ABS = 0.125
BF16_MEAN_ABS = 0.02
BF16_ULP_AT_2 = 2**-6


def write_checkpoint(shape: ModelShape, path: str) -> str:
    """A random Llama-3-style checkpoint (config.json + safetensors) with random norm weights."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": shape.original_max_position_embeddings,
        },
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF initialises norms to 1, which would hide a norm weight applied wrongly
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return path


def run_engine(model_dir: str, backend: str, device: str, dtype: str, scenario: Scenario,
               padded_graph_sizes: tuple[int, ...] = ()) -> dict:
    """Greedy generation of both waves through LLMEngine; what the test compares and checks.

    On CUDA with the Triton backend the engine replays decode steps from CUDA graphs (its default).
    `padded_graph_sizes` gives any device the graphs' static buffers and padding without the capture."""
    loaded = load_model(model_dir, dtype=dtype, device=device, backend=backend)
    config = EngineConfig(
        model=model_dir, dtype=dtype, device=device, attention_backend=backend, block_size=scenario.block_size,
        num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=scenario.max_num_batched_tokens,
        max_model_len=2048,
    )
    engine = LLMEngine(loaded, config)
    if padded_graph_sizes:
        engine.runner.decode_graphs = DecodeGraphs(loaded.model, engine.runner.kv_cache, scenario.block_size, 2048,
                                                   list(padded_graph_sizes), capture=False)
    params = SamplingParams(temperature=0.0, max_tokens=scenario.max_tokens, ignore_eos=True)
    wave1, wave2 = scenario.prompts()
    for i, prompt in enumerate(wave1):
        engine.add_request(f"w1-{i}", prompt, params)
    tokens = {f"w1-{i}": [] for i in range(len(wave1))}
    steps_to_first_token = None  # of the longest (chunked) prompt
    most_outputs_in_a_step = 0
    for step in range(1, 10_000):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        most_outputs_in_a_step = max(most_outputs_in_a_step, len(outputs))
        for out in outputs:
            if out.request_id == "w1-0" and steps_to_first_token is None:
                steps_to_first_token = step
            tokens[out.request_id].extend(out.new_token_ids)
    [second] = engine.generate([wave2], params)
    return {
        "ops_modules": {name: getattr(fn, "__module__", "") for name, fn in vars(loaded.model.ops).items()
                        if callable(fn)},
        "wave1": [tokens[f"w1-{i}"] for i in range(len(wave1))],
        "wave2": second.token_ids,
        "wave2_cached_tokens": second.num_cached_tokens,
        "steps_to_first_token": steps_to_first_token,
        "most_outputs_in_a_step": most_outputs_in_a_step,
        "graph_steps": engine.runner.decode_graphs.replays if engine.runner.decode_graphs else 0,
    }


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF `generate`, one prompt at a time (no padding), greedy, never stopping early."""
    device = next(model.parameters()).device
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        results.append(out[0, len(prompt):].tolist())
    return results


def run_triton_engine_in_interpreter(model_dir: str, padded_graph_sizes: tuple[int, ...] = ()) -> dict:
    """run_engine(..., "triton", "cpu", "float32", CPU_SCENARIO) in a subprocess with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONSAFEPATH": "1", "CUDA_VISIBLE_DEVICES": ""}
    sizes = [str(b) for b in padded_graph_sizes]
    done = subprocess.run([sys.executable, __file__, model_dir, *sizes], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, f"Triton engine subprocess failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint folder per scenario name, written on first use."""
    made: dict[str, str] = {}

    def get(where: str) -> str:
        if where not in made:
            made[where] = write_checkpoint(SCENARIOS[where].shape, str(tmp_path_factory.mktemp(f"llama3_{where}")))
        return made[where]

    return get


def check_scenario_ran_as_intended(result: dict, scenario: Scenario) -> None:
    longest, budget = scenario.prompt_lens[0], scenario.max_num_batched_tokens
    assert result["steps_to_first_token"] >= -(-longest // budget), "the long prompt was prefilled in chunks"
    assert result["most_outputs_in_a_step"] >= 2, "several requests sampled in one step"
    assert result["wave2_cached_tokens"] == scenario.shared_prefix_blocks * scenario.block_size, "prefix-cache hit"


@pytest.mark.parametrize("where", ["interpreter", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_triton_engine_greedy_matches_hf_and_torch_backend(where, checkpoints):
    import transformers

    scenario = SCENARIOS[where]
    model_dir = checkpoints(where)
    if where == "interpreter":
        triton = run_triton_engine_in_interpreter(model_dir)
        device = "cpu"
    else:
        device = "cuda"
        triton = run_engine(model_dir, "triton", device, "float32", scenario)
    reference = run_engine(model_dir, "torch", device, "float32", scenario)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    wave1, wave2 = scenario.prompts()
    expected = hf_greedy(hf, [*wave1, wave2], scenario.max_tokens)

    kernels = {name: module for name, module in triton["ops_modules"].items() if name != "compute_cos_sin_cache"}
    assert kernels and all(m.startswith("tandem.workers.kernels.") for m in kernels.values()), kernels
    assert all(m.startswith("tandem.workers.layers.") for m in reference["ops_modules"].values())
    check_scenario_ran_as_intended(triton, scenario)
    check_scenario_ran_as_intended(reference, scenario)
    for i, prompt_len in enumerate(scenario.prompt_lens):
        assert triton["wave1"][i] == expected[i], f"Triton engine vs HF, prompt {i} ({prompt_len} tokens)"
        assert reference["wave1"][i] == expected[i], f"torch engine vs HF, prompt {i} ({prompt_len} tokens)"
    assert triton["wave2"] == expected[-1], "Triton engine vs HF after a prefix-cache hit"
    assert reference["wave2"] == expected[-1], "torch engine vs HF after a prefix-cache hit"
    if where == "cuda":
        assert triton["graph_steps"] > 0, "decode steps were replayed from CUDA graphs"


def test_decode_steps_through_padded_graph_buffers_match_hf(checkpoints):
    """Decode steps through the CUDA-graph runner's static buffers, padded to sizes 2 and 8 (no capture: the
    Triton kernels run in the interpreter), give HF's greedy tokens: padded rows write no KV and disturb
    no real row."""
    import transformers

    scenario = CPU_SCENARIO
    model_dir = checkpoints("interpreter")
    graphs = run_triton_engine_in_interpreter(model_dir, padded_graph_sizes=(2, 8))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    wave1, wave2 = scenario.prompts()
    expected = hf_greedy(hf, [*wave1, wave2], scenario.max_tokens)
    assert graphs["graph_steps"] >= scenario.max_tokens, "decode steps ran through the graph buffers"
    check_scenario_ran_as_intended(graphs, scenario)
    assert graphs["wave1"] == expected[:-1]
    assert graphs["wave2"] == expected[-1]


@pytest.mark.gpu
@needs_cuda
def test_bf16_logits_stay_close_to_hf(checkpoints, attention_metadata):
    """One flattened bf16 prefill of four prompts through the Triton model; logits at each last position."""
    import transformers

    scenario = GPU_SCENARIO
    model_dir = checkpoints("cuda")
    device = torch.device("cuda")
    ours = load_model(model_dir, dtype="bfloat16", device=device, backend="triton")
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompts = [p for p in scenario.prompts()[0] if len(p) in (1, 17, 333, 700)]
    block_size, shape = scenario.block_size, scenario.shape
    needed = [-(-len(p) // block_size) for p in prompts]
    order = torch.randperm(sum(needed) + 5, generator=torch.Generator().manual_seed(0)).tolist()
    tables, start = [], 0
    for n in needed:  # shuffled, non-contiguous blocks
        tables.append(order[start:start + n])
        start += n
    positions, meta = attention_metadata([len(p) for p in prompts], [len(p) for p in prompts], tables, block_size,
                                         device=device)
    kv_cache = torch.zeros(len(order), shape.num_hidden_layers, 2, block_size, shape.num_key_value_heads,
                           shape.head_dim, dtype=torch.bfloat16, device=device)
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)
    with torch.inference_mode():
        hidden = ours.model(input_ids, positions, kv_cache, meta)
        last_rows = meta.query_start_loc[1:].long() - 1
        got = ours.model.compute_logits(hidden[last_rows]).float()
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            want16 = hf16(ids).logits[0, -1].float()
            want32 = hf32(ids).logits[0, -1].float()
            diff = (got[row] - want16).abs()
            label = f"prompt of {len(prompt)} tokens"
            assert diff.max() <= BF16_MAX_ABS, f"{label}: max |ours - HF bf16| = {diff.max():.4f}"
            assert diff.mean() <= BF16_MEAN_ABS, f"{label}: mean |ours - HF bf16| = {diff.mean():.4f}"
            ours_err = (got[row] - want32).abs().max()
            hf_err = (want16 - want32).abs().max()
            assert ours_err <= 2 * hf_err + BF16_ULP_AT_2, f"{label}: bf16 error vs float32 {ours_err:.4f}, HF's {hf_err:.4f}"


def _main() -> None:
    """Subprocess entry: the Triton engine in the interpreter; prints run_engine's result as one JSON line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: this entry point runs the Triton kernels in the CPU interpreter")
    torch.set_num_threads(1)
    sizes = tuple(int(b) for b in sys.argv[2:])
    print(json.dumps(run_engine(sys.argv[1], "triton", "cpu", "float32", CPU_SCENARIO, sizes)))


if __name__ == "__main__":
    _main()
