"""A burst of requests behind one new shared prefix (a system prompt many users share, arriving together).

One SmolLM2 engine in this process (its packaged GGUF, no server). N requests arrive at once, each a new prefix of
--prefix tokens followed by --suffix tokens of its own. Two ways, alternately, each on a fresh engine (empty cache):
  computed once : the engine as it serves (a request whose next uncached block another one is computing waits for
                  it to be cached: workers/engine/block_manager.py);
  each computes : the same engine with that wait turned off (block_manager.wait_for_blocks_being_computed), as it
                  was before: each request admitted in the same step computes the prefix again.
Printed per run: prompt tokens computed, time to first token (median and slowest), and the time until all are done.
Prints conditions and figures; asserts nothing.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/prefix_burst.py [--requests 8] [--prefix 1024] [--suffix 32]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time

import torch

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine, load_engine_model


def burst(loaded, args, waits: bool, seed: int) -> dict:
    config = EngineConfig(model="smollm2", num_kv_blocks=2048, max_num_seqs=64,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(loaded, config)
    engine.block_manager.wait_for_blocks_being_computed = waits
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 20000) for _ in range(args.prefix)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(args.requests):
        engine.add_request(f"r{i}", prefix + [rng.randrange(100, 20000) for _ in range(args.suffix)], params)
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
    ttft = sorted(first_token.values())
    return dict(computed=engine.num_computed_prompt_tokens, ttft_p50=statistics.median(ttft), ttft_max=ttft[-1],
                done=time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024, help="the shared prefix's length in tokens")
    ap.add_argument("--suffix", type=int, default=32, help="each request's own tokens after it")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    loaded = load_engine_model(EngineConfig(model="smollm2"))
    print(f"== conditions == {datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), load average {os.getloadavg()[0]:.2f}")
    print(f"SmolLM2-135M (GGUF), {args.requests} requests at once: a new {args.prefix}-token prefix + "
          f"{args.suffix} tokens each, {args.max_tokens} new tokens each, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, block size 16, prefix caching on")
    burst(loaded, args, True, seed=0)  # warm-up: first runs of each shape
    print("\n| run | how | prompt tokens computed | TTFT p50 | TTFT slowest | all done |")
    print("|---|---|---|---|---|---|")
    results: dict[bool, list[dict]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for waits in (False, True):
            r = burst(loaded, args, waits, seed=1 + repeat)
            results[waits].append(r)
            print(f"| {repeat + 1} | {'computed once' if waits else 'each computes'} | {r['computed']:,} | "
                  f"{r['ttft_p50']:.2f} s | {r['ttft_max']:.2f} s | {r['done']:.2f} s |", flush=True)
    print()
    for key, label in (("computed", "prompt tokens computed"), ("ttft_p50", "TTFT p50"),
                       ("ttft_max", "TTFT slowest"), ("done", "all done")):
        once = statistics.median(r[key] for r in results[True])
        each = statistics.median(r[key] for r in results[False])
        print(f"{label}: computed once / each computes = {once / each:.2f}x (medians over {args.repeats} runs)")


if __name__ == "__main__":
    main()
