"""Engine throughput on CPU, side by side with HF transformers on the same weights, same run (issue 2).

For each dtype (float32: ours f32 vs HF f32; bfloat16: ours bf16 vs HF bf16):
(a) batch-1 decode: one request, 32-token prompt, 128 new tokens; tokens/s of the whole request (prefill
    included, for both), best of 5 runs, ours and HF interleaved. Ours serves as a CPU worker does: decode
    GEMMs read the file's Q4_1/Q8_0 blocks (the same weights to the bit as HF's dequantized ones);
    --quantized-gemv off reads the float weights, as HF does.
(b) 32 concurrent requests, prompts 32-512 and outputs 16-256 tokens (seeded): aggregate output tokens/s.
    Ours: all submitted at once, continuous batching. HF: `generate` on the same requests in static,
    left-padded batches (each batch runs until its longest request is done; only the tokens each request
    asked for are counted, for both).
(c) one decode step's attention (30 layers, SmolLM2's 9 query / 3 KV heads of 64, block 16, KV cache on
    2 MiB pages as the engine keeps it), 1 and 32 sequences of seeded lengths 64-700: the torch reference
    path (gather + SDPA) against the native CPU kernel, and the kernel's KV bytes read per second as a
    fraction of the read-only bandwidth measured in the same run.
(d) all GEMMs of one decode step (the LM head included) at 1-32 rows, from the GGUF file's quantized
    blocks (the native GEMV ours uses for small batches) against the float weights: where the cut-off
    workers/models/llama.py MAX_GGUF_BLOCK_ROWS comes from.
Also: batch-1 decode as a fraction of the memory roofline (weight bytes per token / single-process memory
bandwidth measured in the same run), and the load average around each measurement.
Targets (issue 2): (a) >= 1.5x HF, (b) >= 3x HF. Prints conditions and ratios; never asserts.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/engine_cpu.py [--quick] [--threads N] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import os
import platform
import random
import time
from dataclasses import dataclass

# Before tqdm is imported (it reads its environment then): transformers' GGUF dequantization bar uses it.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.protocol import SamplingParams  # noqa: E402
from tandem.workers.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.workers.kernels.gguf_linear import gguf_linear  # noqa: E402
from tandem.workers.layers.ops import resolve_backend  # noqa: E402
from tandem.workers.models.llama import MAX_GGUF_BLOCK_ROWS  # noqa: E402
from tandem.workers.models.loader import load_model, resolve_model_source  # noqa: E402

Work = list[tuple[list[int], int]]  # (prompt token ids, output length) per request


# ----------------------------------------------------------------------------- conditions


def cpu_description() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} logical CPUs" + (f" ({', '.join(isa)})" if isa else "")


def load_average() -> str:
    try:
        return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "load average unavailable"


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(size_bytes: int = 1 << 30) -> tuple[float, float]:
    """(memcpy GB/s: bytes copied per second, each byte read once and written once; read-only GB/s: bytes
    summed per second), best of 5, with the benchmark's thread count."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    copy_s = best_seconds(lambda: dst.copy_(src), 5)
    read_s = best_seconds(lambda: src.sum(), 5)
    return size_bytes / copy_s / 1e9, size_bytes / read_s / 1e9


def decode_weight_bytes(model, gguf_blocks: bool) -> int:
    """Bytes of weights one batch-1 decode step must read: every GEMM weight (the LM head included) and the
    other parameters (norms, biases); the embedding table only contributes the one row it looks up, counted
    as nothing unless it is the head. With gguf_blocks, a GEMM that has its GGUF blocks (quantized GEMV)
    reads those instead of its float weight."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    gemms = {id(gemm.weight): gemm for gemm in model.gemms()}
    total = sum(nbytes(gemm.blocks.data) if gguf_blocks and gemm.blocks is not None else nbytes(gemm.weight)
                for gemm in gemms.values())
    embedding = model.model.embed_tokens.weight
    return total + sum(nbytes(p) for p in model.parameters() if id(p) not in gemms and p is not embedding)


# ----------------------------------------------------------------------------- workloads


def make_workload(n: int, seed: int, vocab_ids: range, prompt_range=(32, 512), output_range=(16, 256)) -> Work:
    rng = random.Random(seed)
    return [
        ([rng.choice(vocab_ids) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


@dataclass
class Run:
    seconds: float  # wall clock
    cpu_seconds: float  # process CPU time (all threads): less sensitive to other load on a shared machine
    outputs: list[list[int]]


class _Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_ours(engine: LLMEngine, work: Work) -> Run:
    """All requests submitted at once, stepped to completion; greedy, EOS ignored."""
    with _Clock() as clock:
        results = engine.generate(
            [p for p, _ in work], [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
        )
    return Run(clock.wall, clock.cpu, [r.token_ids for r in results])


def run_hf(model, work: Work, batch_size: int, pad_id: int) -> Run:
    """HF generate on static, left-padded batches of `batch_size` requests in arrival order; greedy, running
    each batch to its longest requested output (EOS ignored, as ours)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    config.pad_token_id = pad_id
    outputs: list[list[int]] = []
    with _Clock() as clock:
        for b in range(0, len(work), batch_size):
            batch = work[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):  # left padding, as HF wants for decoder-only generate
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            config.max_new_tokens = config.min_new_tokens = max(o for _, o in batch)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            outputs.extend(out[row, width : width + o].tolist() for row, (_, o) in enumerate(batch))
    return Run(clock.wall, clock.cpu, outputs)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    prefix = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return f"identical outputs {same}/{len(ours)}, mean common prefix {100 * sum(prefix) / len(prefix):.0f}%"


# ----------------------------------------------------------------------------- one dtype


def _attention_step(paged_attention, cache, query, lengths, tables) -> None:
    """One decode step's attention over every layer of `cache` for len(lengths) sequences."""
    from tandem.workers.layers.metadata import AttentionMetadata

    num_seqs = len(lengths)
    meta = AttentionMetadata(  # fresh each step: both paths cache their per-step plan on it
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=tables,
        query_lens_list=[1] * num_seqs, seq_lens_list=lengths, max_query_len=1, max_seq_len=max(lengths))
    for layer in range(cache.shape[1]):
        paged_attention(query, cache[:, layer, 0], cache[:, layer, 1], meta, query.shape[-1] ** -0.5)


def bench_decode_attention(dtype: str, read_gbs: float) -> None:
    """(c): see the module docstring."""
    from tandem.workers.engine.huge_pages import collapse_into_huge_pages
    from tandem.workers.kernels import cpu_attention, cpu_extension
    from tandem.workers.layers import attention

    if not cpu_extension.available():
        print(f"(c) decode attention: the CPU kernel is unavailable ({cpu_extension.build_error()})")
        return
    layers, heads, kv_heads, head_dim, block_size, num_blocks = 30, 9, 3, 64, 16, 2048
    torch_dtype = getattr(torch, dtype)
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim).to(torch_dtype)
    huge = collapse_into_huge_pages([cache])
    rng = random.Random(0)
    print(f"(c) decode attention, one step of {layers} layers, {dtype}, KV cache {cache.nbytes / 2**20:.0f} MiB "
          f"({huge / 2**20:.0f} MiB on 2 MiB pages), blocks scattered at random; best of 5")
    for num_seqs in (1, 32):
        lengths = [rng.randint(64, 700) for _ in range(num_seqs)]
        blocks = [-(-n // block_size) for n in lengths]
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_seqs)).tolist()
        tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
        for b, n in enumerate(blocks):
            tables[b, :n] = torch.tensor(order[:n])
            order = order[n:]
        query = torch.randn(num_seqs, heads, head_dim).to(torch_dtype)

        def timed(paged_attention, args=(cache, query, lengths, tables)):
            return best_seconds(lambda: _attention_step(paged_attention, *args), 5)

        torch_s, kernel_s = timed(attention.paged_attention), timed(cpu_attention.paged_attention)
        kv_bytes = sum(lengths) * layers * 2 * kv_heads * head_dim * cache.element_size()
        print(f"    {num_seqs:2d} sequences, {sum(lengths):5d} context tokens: torch path {1e3 * torch_s:6.2f} ms, "
              f"kernel {1e3 * kernel_s:6.2f} ms = {torch_s / kernel_s:.2f}x; kernel reads {kv_bytes / 1e6:.0f} MB "
              f"of KV at {kv_bytes / kernel_s / 1e9:.1f} GB/s = {100 * kv_bytes / kernel_s / 1e9 / read_gbs:.0f}% "
              f"of the read-only bandwidth")
    del cache
    gc.collect()


def _run_gemms(gemms, x: dict[int, torch.Tensor], from_blocks: bool) -> None:
    """Every GEMM once on x[its input width]: through the GGUF GEMV, or linear() on the float weights."""
    from tandem.workers.models.llama import linear

    for gemm in gemms:
        if from_blocks:
            gguf_linear(x[gemm.weight.shape[1]], gemm.blocks, gemm.bias)
        else:
            linear(x[gemm.weight.shape[1]], gemm.weight, gemm.bias, gemm.packed)


def bench_gemms_by_rows(model, dtype: str) -> None:
    """(d): see the module docstring."""
    torch_dtype = getattr(torch, dtype)
    gemms = model.gemms()
    if any(gemm.blocks is None for gemm in gemms):
        print("(d) GEMMs by rows: skipped, not every GEMM has GGUF blocks here (--quantized-gemv off, or no kernel)")
        return
    cutoff = MAX_GGUF_BLOCK_ROWS[torch_dtype]
    print(f"(d) all {len(gemms)} GEMMs of one decode step by rows: from GGUF blocks vs from the float weights "
          f"(oneDNN-packed from 4 rows); best of 5; ours reads blocks up to {cutoff} rows")
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 12, 16, 24, 32):
            x = {k: torch.randn(rows, k).to(torch_dtype) for k in {gemm.weight.shape[1] for gemm in gemms}}
            blocks_s = best_seconds(functools.partial(_run_gemms, gemms, x, from_blocks=True), 5)
            floats_s = best_seconds(functools.partial(_run_gemms, gemms, x, from_blocks=False), 5)
            print(f"    {rows:3d} rows: blocks {1e3 * blocks_s:6.1f} ms, float {1e3 * floats_s:6.1f} ms "
                  f"= {floats_s / blocks_s:.2f}x")


def bench_dtype(dtype: str, args, hf_path: str, bandwidth: tuple[float, float]) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    backend = resolve_backend(args.attention_backend, "cpu")
    loaded = load_model("smollm2", dtype=dtype, device="cpu", backend=backend, quantized_gemv=args.quantized_gemv)
    engine = LLMEngine(loaded, EngineConfig(
        model="smollm2", dtype=dtype, device="cpu", num_kv_blocks=2048, max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
    ))
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(hf_path), gguf_file=os.path.basename(hf_path), dtype=torch_dtype
    ).eval()
    pad_id = 0
    vocab_ids = range(100, 40000)
    cfg = engine.config
    print(f"\n== {dtype}: ours ({loaded.config.name}, block {cfg.block_size}, max_num_batched_tokens "
          f"{cfg.max_num_batched_tokens}, max_num_seqs {cfg.max_num_seqs}, prefix caching off, attention {backend}, "
          f"{loaded.gguf_block_gemms} GEMMs read GGUF blocks at <= {MAX_GGUF_BLOCK_ROWS[torch_dtype]} rows) vs HF "
          f"transformers {dtype} (attn {hf.config._attn_implementation}) ==")

    # Warm-up: first calls pay for oneDNN primitive creation and allocator growth, for both.
    warm = make_workload(2, seed=99, vocab_ids=vocab_ids, prompt_range=(16, 64), output_range=(8, 8))
    run_ours(engine, warm)
    run_hf(hf, warm, 2, pad_id)

    # (a) batch-1 decode. A new prompt for every run (same set for both), so nothing is cached across runs.
    new_tokens = 32 if args.quick else 128
    repeats = 1 if args.quick else 5
    prompts = make_workload(repeats, seed=1, vocab_ids=vocab_ids, prompt_range=(32, 32),
                            output_range=(new_tokens, new_tokens))
    print(f"(a) batch-1 decode, prompt 32, {new_tokens} new tokens, best of {repeats}; {load_average()}")
    # Interleaved, so that load from other processes on a shared machine falls on both alike.
    ours_runs, hf_runs = [], []
    for w in prompts:
        ours_runs.append(run_ours(engine, [w]))
        hf_runs.append(run_hf(hf, [w], 1, pad_id))
    ours_a, ours_a_cpu = min(r.seconds for r in ours_runs), min(r.cpu_seconds for r in ours_runs)
    hf_a, hf_a_cpu = min(r.seconds for r in hf_runs), min(r.cpu_seconds for r in hf_runs)
    weight_bytes = decode_weight_bytes(loaded.model, gguf_blocks=True)
    hf_weight_bytes = decode_weight_bytes(loaded.model, gguf_blocks=False)
    ms_per_token = 1e3 * ours_a / new_tokens
    memcpy_gbs, read_gbs = bandwidth
    roofline_ms = weight_bytes / (memcpy_gbs * 1e9) * 1e3
    read_roofline_ms = weight_bytes / (read_gbs * 1e9) * 1e3
    print(f"    ours {new_tokens / ours_a:7.1f} tok/s ({ms_per_token:.1f} ms/token)   HF {new_tokens / hf_a:7.1f} tok/s "
          f"({1e3 * hf_a / new_tokens:.1f} ms/token)   ratio {hf_a / ours_a:.2f}x (target >= 1.5x); "
          f"CPU time {ours_a_cpu:.2f} s vs {hf_a_cpu:.2f} s = {hf_a_cpu / ours_a_cpu:.2f}x")
    print(f"    {agreement([r.outputs[0] for r in ours_runs], [r.outputs[0] for r in hf_runs])}")
    print(f"    roofline: {weight_bytes / 1e6:.0f} MB of weights per token; at the measured memcpy "
          f"{memcpy_gbs:.1f} GB/s that is {roofline_ms:.1f} ms/token -> ours at {100 * roofline_ms / ms_per_token:.0f}% "
          f"of it; at the read-only {read_gbs:.1f} GB/s, {read_roofline_ms:.1f} ms/token -> "
          f"{100 * read_roofline_ms / ms_per_token:.0f}%")
    if weight_bytes != hf_weight_bytes:
        hf_ms = 1e3 * hf_a / new_tokens
        print(f"    HF reads the dequantized {hf_weight_bytes / 1e6:.0f} MB per token: "
              f"{hf_weight_bytes / (read_gbs * 1e9) * 1e3:.1f} ms/token at the read-only bandwidth -> HF at "
              f"{100 * hf_weight_bytes / (read_gbs * 1e9) * 1e3 / hf_ms:.0f}% of its own roofline")

    bench_decode_attention(dtype, read_gbs)
    bench_gemms_by_rows(loaded.model, dtype)

    # (b) concurrent, mixed lengths.
    n = 8 if args.quick else 32
    work = make_workload(n, seed=0, vocab_ids=vocab_ids)
    useful = sum(o for _, o in work)
    hf_batch = min(args.hf_batch_size, n)
    print(f"(b) {n} concurrent requests, prompts {min(len(p) for p, _ in work)}-{max(len(p) for p, _ in work)}, "
          f"outputs {min(o for _, o in work)}-{max(o for _, o in work)} (seed 0): {sum(len(p) for p, _ in work)} prompt "
          f"tokens, {useful} output tokens; HF static left-padded batches of {hf_batch}; {load_average()}")
    ours_b = run_ours(engine, work)
    hf_b = run_hf(hf, work, hf_batch, pad_id)
    print(f"    ours {useful / ours_b.seconds:7.1f} tok/s ({ours_b.seconds:.1f} s)   HF {useful / hf_b.seconds:7.1f} tok/s "
          f"({hf_b.seconds:.1f} s)   ratio {hf_b.seconds / ours_b.seconds:.2f}x (target >= 3x); CPU time "
          f"{ours_b.cpu_seconds:.1f} s vs {hf_b.cpu_seconds:.1f} s = {hf_b.cpu_seconds / ours_b.cpu_seconds:.2f}x; "
          f"{load_average()}")
    print(f"    {agreement(ours_b.outputs, hf_b.outputs)}")

    # A readable sample, to show the dtype produces sensible text (a chat prompt, greedy).
    tokenizer = loaded.tokenizer
    sample = None
    if tokenizer is not None and hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ids = tokenizer.encode(text, add_special_tokens=False)
        result = engine.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0]
        sample = result.text.strip().replace("\n", " ")
        print(f"    sample ({dtype}, greedy): {sample!r}")

    del engine, hf, loaded
    gc.collect()
    return {
        "dtype": dtype, "a_ours": new_tokens / ours_a, "a_hf": new_tokens / hf_a, "a_ratio": hf_a / ours_a,
        "a_cpu_ratio": hf_a_cpu / ours_a_cpu, "b_cpu_ratio": hf_b.cpu_seconds / ours_b.cpu_seconds,
        "roofline": roofline_ms / ms_per_token, "read_roofline": read_roofline_ms / ms_per_token,
        "b_ours": useful / ours_b.seconds, "b_hf": useful / hf_b.seconds, "b_ratio": hf_b.seconds / ours_b.seconds,
        "hf_batch": hf_batch, "n": n, "new_tokens": new_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: (a) 32 new tokens once, (b) 8 requests")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, each run ours vs HF")
    ap.add_argument("--hf-batch-size", type=int, default=32, help="HF static batch size for (b)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our per-step token budget")
    ap.add_argument("--quantized-gemv", default="auto", choices=["auto", "off"],
                    help="ours: auto = decode GEMMs of small batches read the GGUF's Q4_1/Q8_0 blocks (as a CPU "
                    "worker serves); off = the dequantized weights, as HF")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"],
                    help="ours: auto = what a CPU worker serves with (the native kernel where it builds)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()  # GGUF load chatter and progress bars
    transformers.utils.logging.disable_progress_bar()

    hf_path = resolve_model_source("smollm2")
    print("== conditions ==")
    print(f"date {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"CPU {cpu_description()}")
    print(f"threads {torch.get_num_threads()} (torch.set_num_threads; default is all {os.cpu_count()} cores)")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"model SmolLM2-135M-Instruct ({os.path.basename(hf_path)}, dequantized to each dtype by both; ours also "
          f"reads its blocks for small batches: --quantized-gemv {args.quantized_gemv})")
    print(f"{load_average()}")
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth (1 GiB buffers, {torch.get_num_threads()} threads): memcpy {bandwidth[0]:.1f} GB/s, "
          f"read-only (sum) {bandwidth[1]:.1f} GB/s")

    results = [bench_dtype(dtype.strip(), args, hf_path, bandwidth) for dtype in args.dtypes.split(",")]

    print("\n== summary (ratio = HF time / our time) ==")
    for r in results:
        print(f"{r['dtype']:>8}  (a) batch-1, {r['new_tokens']} tokens: {r['a_ours']:6.1f} vs {r['a_hf']:6.1f} tok/s = "
              f"{r['a_ratio']:.2f}x (target 1.5x; CPU time {r['a_cpu_ratio']:.2f}x), {100 * r['roofline']:.0f}% of memcpy roofline / "
              f"{100 * r['read_roofline']:.0f}% of read roofline")
        print(f"{'':>8}  (b) {r['n']} concurrent: {r['b_ours']:6.1f} vs {r['b_hf']:6.1f} tok/s = {r['b_ratio']:.2f}x "
              f"(target 3x; CPU time {r['b_cpu_ratio']:.2f}x), HF batch {r['hf_batch']}")
    print(load_average())


if __name__ == "__main__":
    main()
