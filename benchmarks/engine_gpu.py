"""Engine on a CUDA GPU: batch-1 decode against the HBM roofline, and throughput against HF transformers.

Model: Llama-3-8B-shaped (the Llama 3.1 8B config: 32 layers, hidden 4096, 32 query / 8 KV heads, head dim
128, MLP 14336, vocab 128256, llama3 rope scaling) with random bf16 weights drawn on the device, one
HF-named tensor at a time, through the model's checkpoint loader: nothing is downloaded or read from disk.
HF transformers' LlamaForCausalLM is built over the same weight tensors (views into ours, no copy), and
every one of its parameters is checked bit for bit against the random tensor that was loaded under its name.

(0) Device-to-device copy bandwidth: dst.copy_(src) of a 2 GiB buffer, (read + write bytes) / s, as
    benchmarks/kernels_gpu.py measures it.
(a) Batch-1 decode, prompt 128, 256 new tokens: decode tokens/s (first token to last) and the roofline
    fraction = measured / (copy bandwidth / (weight bytes + KV bytes read per step)). Weight bytes per step
    are every parameter except the input embedding, of which one row is read; KV bytes are the mean over
    the decode steps of the keys and values attended to. Target >= 85%. HF batch-1 decode alongside.
(b) 64, 128 and 256 concurrent requests, prompt 512, output 256 (random ids, EOS ignored, no shared
    prefixes): output tokens/s, ours (continuous batching, chunked prefill) vs HF `generate` on static
    batches of the same requests (one batch of all of them; halved when HF runs out of memory, and said so).
    Targets: >= 20x HF at 64; >= 10,000 tok/s at 256 on an H100.
(c) The attention kernel alone: runs benchmarks/kernels_gpu.py (decode 64 x 4,096, prefill 4,096).

Prints its conditions and every figure; never asserts. Without CUDA it exits with a message, unless
--dry-run: a tiny model on the CPU with the torch backend and short lengths, which runs every code path
above except (c) (its figures say nothing about a GPU).

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/engine_gpu.py [--dry-run] [--skip-hf] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.layers.ops import get_ops
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.llama import LlamaForCausalLM
from tandem.workers.models.loader import LoadedModel, default_dtype

KERNELS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_gpu.py")
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama


def llama3_8b_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, rope_scaling=dict(LLAMA3_ROPE_SCALING), tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=[128001, 128008, 128009], name="random-llama-3-8b",
    )  # fmt: skip


def tiny_config() -> ModelConfig:
    """--dry-run's model: the same architecture, small enough for a CPU."""
    scaling = dict(LLAMA3_ROPE_SCALING, original_max_position_embeddings=256)
    return ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048,
        rope_scaling=scaling, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2], name="random-tiny-llama",
    )  # fmt: skip


def hf_llama_config(config: ModelConfig):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_ids,
        attn_implementation="sdpa",
    )  # fmt: skip


# -- random weights, ours and HF's over the same tensors ---------------------------------------------------


def random_weight(index: int, name: str, shape: torch.Size, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """The random tensor for HF parameter `name` (index-th in HF's order): reproducible, so it can be re-drawn
    to check what a model holds. Norm weights are 1, as in a freshly initialised Llama."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=generator)


def hf_skeleton(config: ModelConfig):
    """HF's LlamaForCausalLM on the meta device: its parameter names and shapes, no memory."""
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(hf_llama_config(config))


def build_random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, backend: str, seed: int
                       ) -> tuple[LoadedModel, object]:
    """(our LoadedModel with random weights, HF's LlamaForCausalLM sharing them)."""
    hf = hf_skeleton(config)
    names_shapes = [(name, p.shape) for name, p in hf.named_parameters()]

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, shape) in enumerate(names_shapes):
            yield name, random_weight(index, name, shape, dtype, device, seed)

    # Allocated uninitialised in the target dtype on the device, then filled by the checkpoint loader.
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config, get_ops(backend))
    model.load_weights(weights())
    model.eval()
    loaded = LoadedModel(model=model, config=config, tokenizer=None, source="random weights", dtype=dtype,
                         device=device)
    share_weights_with_hf(model, hf, device)
    for index, (name, shape) in enumerate(names_shapes):
        if not torch.equal(hf.get_parameter(name), random_weight(index, name, shape, dtype, device, seed)):
            raise RuntimeError(f"HF parameter {name} does not hold the weights our model was loaded with")
    return loaded, hf


# Our fused projections: HF module name -> (our fused module name, shard index in it).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def our_tensor_for(model: LlamaForCausalLM, hf_name: str) -> torch.Tensor:
    """The tensor (or row slice of a fused one) of our model that holds HF parameter hf_name."""
    module_path, _, leaf = hf_name.rpartition(".")
    parent_path, _, module_name = module_path.rpartition(".")
    if module_name in _FUSED:
        fused_name, shard = _FUSED[module_name]
        owner = model.get_submodule(parent_path)
        sizes = owner.shard_sizes
        return getattr(owner, fused_name).weight.narrow(0, sum(sizes[:shard]), sizes[shard])
    return model.get_parameter(hf_name)


def share_weights_with_hf(model: LlamaForCausalLM, hf, device: torch.device) -> None:
    """Points every parameter of the meta-device HF model at our tensors and rebuilds its RoPE buffers."""
    for name, meta_param in list(hf.named_parameters()):
        tensor = our_tensor_for(model, name)
        if tensor.shape != meta_param.shape:
            raise RuntimeError(f"{name}: our tensor is {tuple(tensor.shape)}, HF expects {tuple(meta_param.shape)}")
        module_path, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(module_path), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    with torch.device(device):  # non-persistent buffers (inv_freq) are computed, not loaded
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF model still has meta tensors: {left[:5]}")
    hf.eval()


# -- byte counts -----------------------------------------------------------------------------------------


def weight_bytes_per_decode_step(model: LlamaForCausalLM, config: ModelConfig) -> tuple[int, int]:
    """(all weight bytes, weight bytes a batch-1 decode step reads): an untied input embedding is read one
    row per token, everything else whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if config.tie_word_embeddings:
        return total, total
    row = embedding.shape[1] * embedding.element_size()
    return total, total - embedding.numel() * embedding.element_size() + row


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8


def mean_decode_context(prompt_len: int, new_tokens: int) -> float:
    """Mean number of cached tokens a decode step attends to: the step that samples output token j (j >= 2)
    runs token j-1 over prompt_len + j - 1 keys."""
    return statistics.fmean(prompt_len + j - 1 for j in range(2, new_tokens + 1))


# -- timing ----------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=50, rep=500, return_mode="median") * 1e-3
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """(bytes read + bytes written) / s of dst.copy_(src), the practical ceiling of a memory-bound kernel."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, reps=20)


# -- ours ------------------------------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=generator).tolist()


@dataclass
class Batch1Decode:
    tokens: list[int]
    decode_tok_s: float  # output tokens after the first / time from the first token to the last
    total_s: float


def ours_batch1(engine: LLMEngine, prompt: list[int], new_tokens: int, tag: str) -> Batch1Decode:
    device = engine.runner.device
    synchronize(device)
    start = time.perf_counter()
    engine.add_request(tag, prompt, greedy(new_tokens))
    tokens, first_at = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if first_at is None and tokens:
                first_at = time.perf_counter()
    synchronize(device)
    end = time.perf_counter()
    return Batch1Decode(tokens, (len(tokens) - 1) / (end - first_at), end - start)


def ours_concurrent(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    """Seconds until every request, all submitted at once, has its new_tokens."""
    device = engine.runner.device
    synchronize(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, greedy(new_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    synchronize(device)
    return time.perf_counter() - start


# -- HF transformers -------------------------------------------------------------------------------------


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """One static batch through HF `generate` (left-padded, greedy, exactly new_tokens each): (seconds, tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - start, out[:, width:].tolist()


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_static_batches(hf, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float | None, int, str]:
    """(seconds for all prompts, batch size that fit, note): one batch of all of them, halved on OOM."""
    batch, notes = len(prompts), []
    while batch >= 1:
        try:
            seconds = sum(hf_generate(hf, prompts[i:i + batch], new_tokens, device)[0]
                          for i in range(0, len(prompts), batch))
            return seconds, batch, "; ".join(notes)
        except torch.cuda.OutOfMemoryError:
            notes.append(f"HF out of memory at batch {batch}")
            free_device_memory(device)
            batch //= 2
    return None, 0, "; ".join(notes)


# -- main ------------------------------------------------------------------------------------------------


def print_conditions(args, device: torch.device, config: ModelConfig, dtype: torch.dtype, backend: str,
                     engine_config: EngineConfig, weight_total: int, weight_read: int) -> None:
    import transformers
    import triton

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hardware = (f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
                    f"CUDA {torch.version.cuda}")
    else:
        hardware = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (DRY RUN)"
    print("== conditions ==")
    print(f"device: {hardware}")
    print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}")
    print(f"model: {config.name}, random weights (normal std {WEIGHT_STD}, norms 1), {config.num_layers} layers, "
          f"hidden {config.hidden_size}, {config.num_heads} query / {config.num_kv_heads} KV heads, head dim "
          f"{config.head_dim}, MLP {config.intermediate_size}, vocab {config.vocab_size}, rope "
          f"{config.rope_scaling['rope_type']} (theta {config.rope_theta:g})")
    print(f"dtype {str(dtype).removeprefix('torch.')}; attention backend {backend}; weights "
          f"{weight_total / 1e9:.3f} GB, read per batch-1 decode step {weight_read / 1e9:.3f} GB")
    print(f"engine: block size {engine_config.block_size}, {engine_config.num_kv_blocks} KV blocks, max_num_seqs "
          f"{engine_config.max_num_seqs}, max_num_batched_tokens {engine_config.max_num_batched_tokens}, "
          f"prefix caching {'on' if engine_config.enable_prefix_caching else 'off'}")
    print(f"HF transformers: LlamaForCausalLM over the same tensors, attn_implementation "
          f"{args.hf_attn}, dynamic KV cache, greedy `generate`")
    sys.stdout.flush()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny model, CPU, torch backend, short lengths")
    ap.add_argument("--prompt-len", type=int, help="(a) prompt tokens (default 128; dry run 16)")
    ap.add_argument("--new-tokens", type=int, help="(a) new tokens (default 256; dry run 8)")
    ap.add_argument("--concurrency", help="(b) comma-separated request counts (default 64,128,256; dry run 2,4)")
    ap.add_argument("--batch-prompt-len", type=int, help="(b) prompt tokens (default 512; dry run 32)")
    ap.add_argument("--batch-new-tokens", type=int, help="(b) new tokens (default 256; dry run 8)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="engine per-step token budget")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="(a) timed runs; the median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="no HF transformers runs")
    ap.add_argument("--skip-kernels", action="store_true", help="do not run benchmarks/kernels_gpu.py")
    args = ap.parse_args()
    small = args.dry_run
    defaults = dict(prompt_len=(16, 128), new_tokens=(8, 256), concurrency=("2,4", "64,128,256"),
                    batch_prompt_len=(32, 512), batch_new_tokens=(8, 256))
    for name, (dry, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, dry if small else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.hf_attn = "sdpa"
    for name in ("prompt_len", "new_tokens", "batch_prompt_len", "batch_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2: decode speed is measured from the first token to the last")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency needs positive request counts")
    return args


def main() -> None:
    # The engine's start-up lines (how many attention builds it compiled, graph capture), nothing else.
    logging.basicConfig(level=logging.WARNING, format="    log: %(message)s")
    logging.getLogger("tandem.workers.engine").setLevel(logging.INFO)
    args = parse_args()
    if args.dry_run:
        device, backend, dtype, config = torch.device("cpu"), "torch", torch.float32, tiny_config()
        torch.set_num_threads(1)  # a tiny model's ops gain nothing from more threads, only synchronisation
        copy_nbytes = 64 << 20
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/engine_gpu.py needs a CUDA GPU, and torch sees none (torch.cuda.is_available() "
                     "is False). Run it with --dry-run to exercise it on the CPU with a tiny model.")
        device, backend, dtype, config = torch.device("cuda"), "triton", torch.bfloat16, llama3_8b_config()
        copy_nbytes = 2 << 30

    # (0) copy bandwidth, before anything else holds device memory.
    copy_bw = copy_bandwidth(device, copy_nbytes)

    loaded, hf = build_random_model(config, dtype, device, backend, args.seed)
    weight_total, weight_read = weight_bytes_per_decode_step(loaded.model, config)
    max_len = max(args.prompt_len + args.new_tokens, args.batch_prompt_len + args.batch_new_tokens)
    blocks_per_request = -(-max_len // args.block_size)
    engine_config = EngineConfig(
        model=config.name, served_model_name=config.name, dtype=str(dtype).removeprefix("torch."),
        device=device.type, attention_backend=backend, block_size=args.block_size,
        num_kv_blocks=(max(args.concurrency) + 2) * blocks_per_request, max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
    )  # fmt: skip
    started = time.perf_counter()
    engine = LLMEngine(loaded, engine_config)  # on a GPU: compiles the attention kernel's eager builds, captures graphs
    start_s = time.perf_counter() - started
    print_conditions(args, device, config, dtype, backend, engine_config, weight_total, weight_read)
    print(f"(0) device-to-device copy, {copy_nbytes / 2**30:g} GiB: {copy_bw / 1e12:.3f} TB/s (read + write)")
    print(f"engine start (KV cache, the attention kernel's eager builds, decode graphs): {start_s:.1f} s")

    # Warm-up: every timed case once, short, untimed. The first run of a batch shape compiles the Triton kernels
    # of its prefill and mixed steps (decode steps run from graphs captured at start): on an H200 that made the
    # first 64-request run 1.8x slower than the second (benchmarks/engine_gpu_breakdown.py).
    # Each is run twice and both are printed: what the first run of a shape still pays over the second is what a
    # worker's first requests of that shape would pay after the start-up compile.
    ours_concurrent(engine, random_prompts(1, args.prompt_len, config.vocab_size, args.seed + 1), 8, "warm")
    for n in args.concurrency:
        first, again = (ours_concurrent(engine, random_prompts(n, args.batch_prompt_len, config.vocab_size, seed), 8,
                                        f"warm{n}-{seed}")  # new prompts each time: no prefix-cache hits
                        for seed in (args.seed + 10 + n, args.seed + 5000 + n))
        print(f"warm-up, {n} requests x 8 new tokens: first run {first:.2f} s, second {again:.2f} s")

    # (a) batch-1 decode vs the roofline.
    prompt = random_prompts(1, args.prompt_len, config.vocab_size, args.seed + 2)[0]
    runs = [ours_batch1(engine, prompt, args.new_tokens, f"b1-{r}") for r in range(args.repeats)]
    tok_s = statistics.median(r.decode_tok_s for r in runs)
    kv_read = mean_decode_context(args.prompt_len, args.new_tokens) * kv_bytes_per_token(config, dtype)
    roofline = copy_bw / (weight_read + kv_read)
    print(f"\n(a) batch-1 decode, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"    tandem: {tok_s:.1f} tok/s decode, {1e3 / tok_s:.2f} ms per step (median of {args.repeats}: "
          f"{', '.join(f'{r.decode_tok_s:.1f}' for r in runs)}); {runs[0].total_s:.2f} s end to end")
    print(f"    roofline: {copy_bw / 1e12:.3f} TB/s / ({weight_read / 1e9:.3f} GB weights + {kv_read / 1e6:.1f} MB "
          f"KV per step) = {roofline:.1f} tok/s -> {tok_s / roofline:.1%} of roofline (target >= 85%)")
    sys.stdout.flush()

    # (b) concurrent requests, ours; all runs before HF's so that HF gets the memory our KV cache held.
    ours_seconds = {}
    for n in args.concurrency:
        prompts = random_prompts(n, args.batch_prompt_len, config.vocab_size, args.seed + 100 + n)
        ours_seconds[n] = ours_concurrent(engine, prompts, args.batch_new_tokens, f"c{n}")
        print(f"(b) tandem, {n} concurrent: {n * args.batch_new_tokens / ours_seconds[n]:,.0f} output tok/s "
              f"({ours_seconds[n]:.2f} s)")
        sys.stdout.flush()
    prefix_hits = engine.num_prefix_hit_tokens
    ours_tokens = runs[0].tokens
    del engine, runs
    free_device_memory(device)

    if not args.skip_hf:
        hf_generate(hf, random_prompts(2, args.batch_prompt_len, config.vocab_size, args.seed + 1), 4, device)
        hf_s, hf_tokens = hf_generate(hf, [prompt], args.new_tokens, device)
        agree = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens[0])) if a != b), len(ours_tokens))
        print(f"\n(a) HF transformers batch-1: {args.new_tokens / hf_s:.1f} tok/s end to end; greedy tokens equal to "
              f"tandem's for the first {agree} of {args.new_tokens}")
        print(f"\n(b) prompt {args.batch_prompt_len}, output {args.batch_new_tokens}; prefix-cache hits: "
              f"{prefix_hits} tokens (random prompts share none)")
        for n in args.concurrency:
            prompts = random_prompts(n, args.batch_prompt_len, config.vocab_size, args.seed + 100 + n)
            seconds, batch, note = hf_static_batches(hf, prompts, args.batch_new_tokens, device)
            ours = n * args.batch_new_tokens / ours_seconds[n]
            target = {64: " (target >= 20x)"}.get(n, "")
            if seconds is None:
                print(f"    {n:4d} concurrent: tandem {ours:,.0f} tok/s; HF failed: {note}")
                continue
            theirs = n * args.batch_new_tokens / seconds
            how = f"static batch of {batch}" if batch == n else f"static batches of {batch} ({note})"
            print(f"    {n:4d} concurrent: tandem {ours:,.0f} tok/s, HF {theirs:,.0f} tok/s ({how}) -> "
                  f"{ours / theirs:.1f}x{target}")
            sys.stdout.flush()
    if 256 in ours_seconds:
        print(f"    tandem at 256 concurrent: {256 * args.batch_new_tokens / ours_seconds[256]:,.0f} output tok/s "
              "(target >= 10,000 on an H100)")
    del hf, loaded
    free_device_memory(device)

    # (c) the attention kernel alone.
    if args.dry_run or args.skip_kernels:
        print("\n(c) attention kernel alone: skipped" + (" (needs CUDA)" if args.dry_run else ""))
        return
    print("\n(c) attention kernel alone: benchmarks/kernels_gpu.py", flush=True)
    subprocess.run([sys.executable, KERNELS_SCRIPT], env={**os.environ, "PYTHONSAFEPATH": "1"}, check=False)


if __name__ == "__main__":
    main()
