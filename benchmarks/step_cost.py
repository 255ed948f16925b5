"""How well a worker's step cost model predicts its steps: the start-up calibration's model (tandem.step_cost)
against measured prefills, decode batches of sizes it did not time, and one sequence decoding at a long context.

Model: on a CUDA GPU the Llama-3-8B-shaped random model of benchmarks/engine_gpu.py (bf16, Triton, CUDA graphs);
with --dry-run its tiny model on the CPU. Prints, for each case, the predicted and the measured seconds (median of 3)
and their ratio; never asserts.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/step_cost.py [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_gpu as bench  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.workers.engine import calibration  # noqa: E402
from tandem.workers.engine.llm_engine import LLMEngine  # noqa: E402


def timed(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """The seconds of each step that ran those prompts to new_tokens each, in order."""
    steps = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{time.monotonic_ns()}-{i}", prompt, bench.greedy(new_tokens))
    while engine.has_unfinished_requests():
        bench.synchronize(engine.runner.device)
        started = time.perf_counter()
        engine.step()
        bench.synchronize(engine.runner.device)
        steps.append(time.perf_counter() - started)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        device, backend, dtype, config = torch.device("cpu"), "torch", torch.float32, bench.tiny_config()
        prefills, batches, budget, context = (8, 48, 200), (1, 3, 6), 256, 32
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/step_cost.py needs a CUDA GPU; --dry-run exercises it on the CPU")
        device, backend, dtype, config = torch.device("cuda"), "triton", torch.bfloat16, bench.llama3_8b_config()
        prefills, batches, budget, context = (96, 700, 3000, 8192), (3, 24, 96, 200), 8192, 512
    loaded, hf = bench.build_random_model(config, dtype, device, backend, seed=0)
    del hf
    engine_config = EngineConfig(model=config.name, served_model_name=config.name, device=device.type,
                                 dtype=str(dtype).removeprefix("torch."), attention_backend=backend,
                                 num_kv_blocks=(max(batches) + 4) * (2 * context // 16 + 4) + 2 * budget // 16,
                                 max_num_seqs=max(max(batches), 8), max_num_batched_tokens=budget,
                                 max_model_len=max(budget, 2 * context) + 64)
    engine = LLMEngine(loaded, engine_config)
    os.environ[calibration.CACHE_ENV] = tempfile.mkdtemp()  # measured here, not read from an earlier run's cache
    started = time.perf_counter()
    cost = calibration.calibrate(engine)
    print(f"calibration: {time.perf_counter() - started:.1f} s; model {cost}")
    vocab = config.vocab_size
    print(f"{'case':>28} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for n in prefills:  # one prompt of n tokens, its one step (or chunks), then its first token
        runs = [sum(timed(engine, bench.random_prompts(1, n, vocab, seed), 1)) for seed in range(3)]
        predicted = cost.prefill_s(n, budget=budget)
        measured = statistics.median(runs)
        print(f"{f'prefill {n} tokens':>28} {predicted * 1e3:>8.2f}ms {measured * 1e3:>8.2f}ms {measured / predicted:>6.2f}")
    for b in batches:  # b prompts of `context` tokens, then decode steps at that batch
        steps = timed(engine, bench.random_prompts(b, context, vocab, 100 + b), 8)
        decode_steps = steps[-6:]  # the steps once every sequence decodes
        predicted = cost.decode_step_s(b, b * (context + 4))
        measured = statistics.median(decode_steps)
        print(f"{f'decode step, batch {b}':>28} {predicted * 1e3:>8.2f}ms {measured * 1e3:>8.2f}ms "
              f"{measured / predicted:>6.2f}")
    long = budget - 16  # one sequence at a long context: the attention-pair term's own case
    steps = timed(engine, bench.random_prompts(1, long, vocab, 7), 8)
    predicted, measured = cost.decode_step_s(1, long + 4), statistics.median(steps[-6:])
    print(f"{f'decode step, 1 at {long} tokens':>28} {predicted * 1e3:>8.2f}ms {measured * 1e3:>8.2f}ms "
          f"{measured / predicted:>6.2f}")


if __name__ == "__main__":
    main()
