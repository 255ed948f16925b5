"""Where an engine step's time goes on a CUDA GPU: host vs device, and which kernels.

Same model and engine as benchmarks/engine_gpu.py (Llama-3-8B shape, random bf16 weights, Triton backend,
CUDA graphs for decode). For each case it prints the median wall time of an engine step, the device time of
the same step's work alone, and the kernels that take the most device time in it:
  decode-1    one request decoding (batch-1 decode through the batch-1 graph)
  decode-N    N requests decoding (--batch, default 256), through the graph of N rows
  prefill     one step of --max-num-batched-tokens prompt tokens (16 prompts of 512), run eagerly
Wall minus device time is what the host adds to a step (scheduling, input preparation, sampling's readback).
It also runs engine_gpu.py's throughput case twice in a row at each --concurrency, to show whether the first
run of a shape pays one-time costs (kernel compilation) that the second does not.

Prints its conditions and figures; never asserts.

    PYTHONSAFEPATH=1 python3 benchmarks/engine_gpu_breakdown.py [--batch 256] [--concurrency 64,256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_gpu as bench  # noqa: E402  (the model, engine and request builders of the main GPU benchmark)

from tandem.config import EngineConfig  # noqa: E402
from tandem.workers.engine.llm_engine import LLMEngine  # noqa: E402


def timed_steps(engine: LLMEngine) -> list[float]:
    """Runs the engine until it is idle; the wall time of each step."""
    device, times = engine.runner.device, []
    while engine.has_unfinished_requests():
        bench.synchronize(device)
        start = time.perf_counter()
        engine.step()
        bench.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def kernel_table(engine: LLMEngine, steps: int, label: str, top: int = 12) -> float:
    """Profiles `steps` engine steps; prints the kernels by device time per step; returns device ms per step."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.runner.device
    on_gpu = device.type == "cuda"
    bench.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(steps):
            engine.step()
        bench.synchronize(device)
    kernels = {}
    for event in prof.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            spent = event.device_time
        elif not on_gpu and event.name.startswith("aten::"):  # --dry-run: CPU ops, nested ones counted twice
            spent = event.self_cpu_time_total
        else:
            continue
        total, count = kernels.get(event.name, (0.0, 0))
        kernels[event.name] = (total + spent, count + 1)
    device_us = max(1e-9, sum(total for total, _ in kernels.values()) / steps)
    print(f"  {label}: device time {device_us / 1e3:.3f} ms per step over {steps} profiled steps; top kernels:")
    for name, (total, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {total / steps / 1e3:8.3f} ms {100 * total / steps / device_us:5.1f}%  x{count / steps:5.1f}  "
              f"{name[:90]}")
    return device_us / 1e3


def host_profile(engine: LLMEngine, steps: int, label: str, top: int = 14) -> None:
    """cProfile over `steps` engine steps: the host functions by own time. A call that waits for the device
    (a readback such as .tolist()) shows the wait as its own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt / steps * 1e3
    print(f"  {label}: host profile, {total:.3f} ms per step under cProfile; functions by own time:")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"    {own / steps * 1e3:7.3f} ms own {cumulative / steps * 1e3:7.3f} ms cum  x{calls / steps:6.1f}  "
              f"{name} ({where})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--dry-run", action="store_true", help="tiny model, CPU, torch backend: exercises the code")
    args = ap.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.dry_run:
        device, dtype, config, backend = torch.device("cpu"), torch.float32, bench.tiny_config(), "torch"
    elif torch.cuda.is_available():
        device, dtype, config, backend = torch.device("cuda"), torch.bfloat16, bench.llama3_8b_config(), "triton"
    else:
        sys.exit("benchmarks/engine_gpu_breakdown.py needs a CUDA GPU, and torch sees none (or use --dry-run).")
    loaded, hf = bench.build_random_model(config, dtype, device, backend, seed=0)
    del hf
    max_len = args.prompt_len + args.new_tokens
    top = max(args.batch, *concurrency)
    engine_config = EngineConfig(
        model=config.name, served_model_name=config.name, dtype=str(dtype).removeprefix("torch."),
        device=device.type, attention_backend=backend, block_size=16, num_kv_blocks=(top + 2) * -(-max_len // 16), max_num_seqs=top,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
    )  # fmt: skip
    engine = LLMEngine(loaded, engine_config)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (DRY RUN)"
    print(f"device {name}; torch {torch.__version__}; model "
          f"{config.name}; max_num_batched_tokens {args.max_num_batched_tokens}; graphs for batch sizes "
          f"{engine.runner.decode_graphs.batch_sizes if engine.runner.decode_graphs else 'none'}")

    print("\n== throughput case, each concurrency twice in a row (the first pays any one-time cost) ==")
    for n in concurrency:
        for attempt in (1, 2):
            prompts = bench.random_prompts(n, args.prompt_len, config.vocab_size, seed=100 + n + attempt)
            seconds = bench.ours_concurrent(engine, prompts, args.new_tokens, f"t{n}-{attempt}")
            print(f"  {n} concurrent, run {attempt}: {n * args.new_tokens / seconds:,.0f} output tok/s "
                  f"({seconds:.2f} s)", flush=True)

    print("\n== step breakdown ==")
    cases = [("decode-1", 1, 64), (f"decode-{args.batch}", args.batch, 64)]
    for label, n, new_tokens in cases:
        prompts = bench.random_prompts(n, min(128, max_len - new_tokens), config.vocab_size, seed=7 + n)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{label}-{i}", prompt, bench.greedy(new_tokens))
        for _ in range(8):  # past the prompts' prefill (4 steps of 8,192 tokens at most), into steady decoding
            engine.step()
        device_ms = kernel_table(engine, 8, label)
        host_profile(engine, 16, label)
        walls = timed_steps(engine)[:-1]  # the last step finishes requests and frees blocks
        wall_ms = statistics.median(walls) * 1e3
        print(f"  {label}: wall {wall_ms:.3f} ms per step (median of {len(walls)}) -> host adds "
              f"{wall_ms - device_ms:.3f} ms ({(wall_ms - device_ms) / wall_ms:.0%} of the step)")
        graphs = engine.runner.decode_graphs
        if graphs is not None and n in getattr(graphs, "_graphs", {}):
            from triton.testing import do_bench

            replay_ms = do_bench(graphs._graphs[n].replay, warmup=20, rep=200, return_mode="median")
            print(f"  {label}: the forward pass's graph alone (replayed): {replay_ms:.3f} ms", flush=True)

    prompts = bench.random_prompts(args.max_num_batched_tokens // args.prompt_len, args.prompt_len,
                                   config.vocab_size, seed=99)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{i}", prompt, bench.greedy(2))
    kernel_table(engine, 1, f"prefill ({args.max_num_batched_tokens} tokens)")
    while engine.has_unfinished_requests():
        engine.step()
    bench.synchronize(device)
    start = time.perf_counter()
    for i, prompt in enumerate(bench.random_prompts(len(prompts), args.prompt_len, config.vocab_size, seed=98)):
        engine.add_request(f"prefill2-{i}", prompt, bench.greedy(1))
    engine.step()
    bench.synchronize(device)
    print(f"  prefill: wall {1e3 * (time.perf_counter() - start):.3f} ms for one step of "
          f"{args.max_num_batched_tokens} tokens")
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
