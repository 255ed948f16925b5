"""N-gram speculative decoding on CPU: output tokens/s with and without it, SmolLM2, same run (issue 32).

Two workloads, greedy, ignore_eos: copy-heavy (the prompt is code the model is asked to repeat, so what it writes
is in its prompt) and free writing (a short instruction, little to look up). Each at batch 1 and batch 8 (copies
of the prompt with a distinct first token each, so the prefix cache shares nothing). Tokens/s counts output
tokens over the whole run (prefill included), best of --repeats after a warm-up; ratio = with / without. Also the acceptance rate
and the mean tokens per verified draft, the drafts verified per decode step and sequence (mean k) and the steps
whose drafts were all dropped as not worth verifying. The outputs with and without speculation are checked
identical. Each engine that speculates is calibrated first, as a worker is at start (workers/engine/calibration.py:
the prior of the step cost model its plans are made with; read from the cache after the first time, not timed).
Targets (issue 32): >= 1.5x at batch 1 on the copy-heavy workload, >= 0.95x on free writing. Prints; asserts
nothing but identical outputs.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/spec_decode.py [--max-tokens 128] [--k 4] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.calibration import calibrate
from tandem.workers.engine.llm_engine import LLMEngine, load_engine_model

CODE = '''def parse_line(line):
    fields = line.strip().split(",")
    name, age, city = fields[0], int(fields[1]), fields[2]
    return {"name": name, "age": age, "city": city}


def load(path):
    with open(path) as f:
        return [parse_line(line) for line in f if line.strip()]
'''
COPY = f"Here is some Python code:\n\n{CODE}\nRewrite it exactly, renaming load to read_people:\n\n"
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = {"copy-heavy": COPY, "free writing": FREE}


def chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run(loaded, spec: str | None, prompts: list[list[int]], params: SamplingParams, repeats: int):
    """(best output tokens/s, token ids per request, the engine of the best run, its decode steps' mean k)."""
    best = None
    for _ in range(repeats):
        config = EngineConfig(model="smollm2", num_kv_blocks=1024, max_num_seqs=16, speculative_config=spec,
                              enable_prefix_caching=False)
        engine = LLMEngine(loaded, config)
        if spec is not None:
            calibrate(engine)
        started = time.perf_counter()
        results, ks = generate(engine, prompts, params)
        seconds = time.perf_counter() - started
        rate = sum(len(r.token_ids) for r in results) / seconds
        if best is None or rate > best[0]:
            best = (rate, [r.token_ids for r in results], engine, sum(ks) / max(len(ks), 1))
    return best


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """engine.generate's results, and each decode step's mean k as the engine planned it."""
    ks = []
    planned = engine.spec_stats.planned

    def record(decodes: int, verified: int, skipped: bool) -> None:
        planned(decodes, verified, skipped)
        if decodes:
            ks.append(verified / decodes)

    engine.spec_stats.planned = record
    return engine.generate(prompts, params), ks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lo, hi = map(int, args.lookup.split(","))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": lo,
                       "prompt_lookup_max": hi})
    loaded = load_engine_model(EngineConfig(model="smollm2", device="cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    run(loaded, spec, [chat(loaded.tokenizer, COPY)] * 2, params, 1)  # warm-up: kernels, packed weights
    print(f"SmolLM2-135M on CPU ({os.cpu_count()} logical CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads), {args.max_tokens} new tokens, greedy; speculative config {spec}")
    print(f"{'workload':<14}{'batch':>6}{'plain tok/s':>13}{'ngram tok/s':>13}{'ratio':>8}{'accepted':>10}"
          f"{'tok/draft':>11}{'mean k':>8}{'skipped':>9}")
    for name, text in WORKLOADS.items():
        base = chat(loaded.tokenizer, text)
        for batch in map(int, args.batches.split(",")):
            prompts = [[base[0] + i, *base[1:]] if i else base for i in range(batch)]
            plain_rate, plain_tokens, _, _ = run(loaded, None, prompts, params, args.repeats)
            spec_rate, spec_tokens, engine, mean_k = run(loaded, spec, prompts, params, args.repeats)
            same = "" if spec_tokens == plain_tokens else "  OUTPUTS DIFFER"
            stats = engine.spec_stats
            print(f"{name:<14}{batch:>6}{plain_rate:>13.1f}{spec_rate:>13.1f}{spec_rate / plain_rate:>7.2f}x"
                  f"{stats.acceptance_rate:>10.0%}{stats.mean_accepted_length:>11.2f}{mean_k:>8.2f}"
                  f"{stats.num_skipped_steps:>9}{same}")


if __name__ == "__main__":
    main()
