"""FP8 weights against BF16 on a CUDA GPU: the same random Llama-3-8B-shaped model served by the engine twice.

(a) Batch-1 decode, prompt 128, 256 new tokens: decode tokens/s of each, and FP8 / BF16 (target >= 1.7x), with
    each against its own roofline (copy bandwidth / (weight bytes + KV bytes read per step)).
(b) 64 and 256 concurrent requests, prompt 512, output 256 (random ids, EOS ignored): output tokens/s of each and
    the ratio (target >= 1.4x).
FP8 runs twice where the GPU has FP8 tensor cores: every GEMM through torch._scaled_mm (activations quantized per
token), and with GEMMs of up to 16 rows (decode steps) through the weight-only Triton GEMM instead
(tandem.workers.layers.fp8_linear.WEIGHT_ONLY_MAX_ROWS).

Prints its conditions and every figure; never asserts. --dry-run: a tiny model on the CPU (the FP8 reference path),
short lengths; its figures say nothing about a GPU.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/quant_gpu.py [--dry-run]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_gpu as bench  # noqa: E402  (the model, engine and request builders of the main GPU benchmark)

from tandem.config import EngineConfig  # noqa: E402
from tandem.workers.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.workers.layers import fp8_linear  # noqa: E402


def weight_bytes_read(model, config) -> int:
    """Bytes of weights (parameters and FP8 buffers, scales included) a batch-1 decode step reads: all but the
    input embedding, of which one row."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith(("weight", "weight_scale")))]
    total = sum(t.numel() * t.element_size() for t in tensors)
    if config.tie_word_embeddings:
        return total
    embedding = model.model.embed_tokens.weight
    return total - embedding.numel() * embedding.element_size() + embedding.shape[1] * embedding.element_size()


def run(args, label: str, device, backend, dtype, config, copy_bw: float, quantize: bool) -> dict:
    loaded, hf = bench.build_random_model(config, dtype, device, backend, args.seed)
    del hf
    if quantize:
        started = time.perf_counter()
        loaded.model.quantize_fp8()
        bench.synchronize(device)
        print(f"    quantized to FP8 in {time.perf_counter() - started:.1f} s")
    bench.free_device_memory(device)
    weights = weight_bytes_read(loaded.model, config)
    max_len = max(args.prompt_len + args.new_tokens, args.batch_prompt_len + args.batch_new_tokens)
    engine_config = EngineConfig(
        model=config.name, served_model_name=config.name, dtype=str(dtype).removeprefix("torch."),
        device=device.type, attention_backend=backend, block_size=16,
        num_kv_blocks=(max(args.concurrency) + 2) * -(-max_len // 16), max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=8192, max_model_len=max_len,
    )  # fmt: skip
    engine = LLMEngine(loaded, engine_config)
    results = {"label": label, "weights": weights}
    bench.ours_concurrent(engine, bench.random_prompts(1, args.prompt_len, config.vocab_size, args.seed + 1), 8, "w")
    for n in args.concurrency:  # every batch shape once, untimed: its kernels compile
        bench.ours_concurrent(engine, bench.random_prompts(n, args.batch_prompt_len, config.vocab_size, args.seed + n),
                              8, f"w{n}")
    prompt = bench.random_prompts(1, args.prompt_len, config.vocab_size, args.seed + 2)[0]
    runs = [bench.ours_batch1(engine, prompt, args.new_tokens, f"b1-{r}") for r in range(args.repeats)]
    results["batch1"] = statistics.median(r.decode_tok_s for r in runs)
    kv_read = bench.mean_decode_context(args.prompt_len, args.new_tokens) * bench.kv_bytes_per_token(config, dtype)
    results["roofline"] = copy_bw / (weights + kv_read)
    print(f"(a) {label}: {results['batch1']:.1f} tok/s batch-1 decode ({', '.join(f'{r.decode_tok_s:.1f}' for r in runs)}"
          f"); weights read per step {weights / 1e9:.3f} GB; {results['batch1'] / results['roofline']:.1%} of its "
          f"roofline ({results['roofline']:.1f} tok/s)", flush=True)
    for n in args.concurrency:
        prompts = bench.random_prompts(n, args.batch_prompt_len, config.vocab_size, args.seed + 100 + n)
        seconds = bench.ours_concurrent(engine, prompts, args.batch_new_tokens, f"c{n}")
        results[n] = n * args.batch_new_tokens / seconds
        print(f"(b) {label}, {n} concurrent: {results[n]:,.0f} output tok/s", flush=True)
    del engine, loaded, runs
    bench.free_device_memory(device)
    return results


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="    log: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny model, CPU, torch backend, short lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    small = args.dry_run
    args.prompt_len, args.new_tokens = (16, 8) if small else (128, 256)
    args.batch_prompt_len, args.batch_new_tokens = (32, 8) if small else (512, 256)
    args.concurrency = [2, 4] if small else [64, 256]
    if small:
        device, backend, dtype, config = torch.device("cpu"), "torch", torch.float32, bench.tiny_config()
        torch.set_num_threads(1)
        copy_nbytes = 64 << 20
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/quant_gpu.py needs a CUDA GPU; --dry-run exercises it on the CPU")
        device, backend, dtype, config = torch.device("cuda"), "triton", torch.bfloat16, bench.llama3_8b_config()
        copy_nbytes = 2 << 30
    copy_bw = bench.copy_bandwidth(device, copy_nbytes)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (DRY RUN)"
    print(f"== conditions ==\ndevice: {hardware}; torch {torch.__version__}; model {config.name}, random weights, "
          f"{str(dtype).removeprefix('torch.')} activations; copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    print(f"(a) prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}; (b) prompt "
          f"{args.batch_prompt_len}, output {args.batch_new_tokens}; FP8: e4m3 weights, a scale per output channel; "
          f"GEMMs on this device: "
          f"{'torch._scaled_mm' if fp8_linear.scaled_mm_supported(device) else 'Triton weight-only' if device.type == 'cuda' else 'torch reference'}",
          flush=True)
    variants = [(str(dtype).removeprefix("torch."), False, 0), ("fp8", True, 0)]
    if fp8_linear.scaled_mm_supported(device):
        variants.append(("fp8, decode GEMMs weight-only", True, 16))
    results = []
    for label, quantize, weight_only_rows in variants:
        fp8_linear.WEIGHT_ONLY_MAX_ROWS = weight_only_rows
        try:
            results.append(run(args, label, device, backend, dtype, config, copy_bw, quantize))
        except Exception as exc:  # noqa: BLE001 - one variant failing must not cost the others' figures
            print(f"{label}: FAILED {exc!r}", flush=True)
            bench.free_device_memory(device)
    if len(results) < 2 or results[0]["label"] != variants[0][0]:
        return
    base = results[0]
    print(f"\n== FP8 / {base['label']} ==")
    for r in results[1:]:
        print(f"{r['label']}: batch-1 decode {r['batch1'] / base['batch1']:.2f}x (target >= 1.7x); "
              + "; ".join(f"{n} concurrent {r[n] / base[n]:.2f}x" for n in args.concurrency) + " (target >= 1.4x)")


if __name__ == "__main__":
    main()
