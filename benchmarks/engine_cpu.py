"""Engine throughput on CPU, side by side with HF transformers on the same weights, same run.

(a) batch-1 decode: tokens/s generating 128 new tokens after a short prompt.
(b) 32 concurrent requests, prompts 32-512 and outputs 16-256 tokens (seeded): aggregate output
    tokens/s, ours with continuous batching vs HF `generate` on the same requests in static,
    left-padded batches (each batch runs until its longest request is done; only the tokens each
    request asked for are counted, for both).
Targets (issue 2): (a) >= 1.5x HF, (b) >= 3x HF. Prints conditions and ratios; never asserts.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/engine_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.models.loader import load_model, resolve_model_source


def make_workload(n: int, seed: int, vocab_ids: list[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.choice(vocab_ids) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_ours(engine: LLMEngine, work: list[tuple[list[int], int]]) -> float:
    """Seconds to finish all requests, submitted at once."""
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(f"r{i}-{start}", prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run_hf(model, work: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(work), batch_size):
        batch = work[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):  # left padding, as HF wants for decoder-only generate
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 requests instead of 32 (smoke run)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_model_source("smollm2")
    loaded = load_model("smollm2", dtype="float32", device="cpu", backend="torch")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    engine = LLMEngine(loaded, EngineConfig(model="smollm2", num_kv_blocks=2048, max_num_seqs=64,
                                            max_num_batched_tokens=2048))
    vocab_ids = list(range(100, 40000))
    n = 8 if args.quick else 32

    print("== conditions ==")
    print(f"model SmolLM2-135M-Instruct (GGUF Q4_1 dequantized), float32, CPU {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}")

    # (a) batch-1 decode, 128 new tokens after a 16-token prompt; one warm-up run each.
    prompt = vocab_ids[:16]
    one = [(prompt, 128)]
    run_ours(engine, [(prompt, 8)])
    run_hf(hf, [(prompt, 8)], 1, pad_id=0)
    ours_s = min(run_ours(engine, one) for _ in range(2))
    hf_s = min(run_hf(hf, one, 1, pad_id=0) for _ in range(2))
    print("== (a) batch-1 decode, prompt 16, 128 new tokens ==")
    print(f"tandem {128 / ours_s:7.1f} tok/s   HF transformers {128 / hf_s:7.1f} tok/s   "
          f"ratio {hf_s / ours_s:.2f}x (target >= 1.5x)")

    # (b) concurrent mixed lengths.
    work = make_workload(n, seed=0, vocab_ids=vocab_ids)
    useful = sum(o for _, o in work)
    ours_s = run_ours(engine, work)
    hf_s = run_hf(hf, work, args.hf_batch_size, pad_id=0)
    print(f"== (b) {n} concurrent requests, prompts 32-512, outputs 16-256 (seed 0), {useful} output tokens ==")
    print(f"tandem {useful / ours_s:7.1f} tok/s ({ours_s:.1f} s)   HF static batches of {args.hf_batch_size} "
          f"{useful / hf_s:7.1f} tok/s ({hf_s:.1f} s)   ratio {hf_s / ours_s:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
