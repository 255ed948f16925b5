"""Tensor parallelism's communication: what one engine step exchanges between ranks, measured on CPU processes
(gloo) at TP 1, 2 and 3, and modelled for a GPU fleet.

Measured: an engine split over N ranks (this process is rank 0; the others are real follower processes, as
`tandem worker --tensor-parallel-size N` starts them) runs a prefill workload and a decode workload. Every
collective rank 0 runs is counted: all-reduces (one after each row-parallel GEMM: o_proj and down_proj per layer,
and the vocabulary-parallel embedding), all-gathers (the vocabulary-parallel LM head) and the broadcast of each
step's inputs. Printed per step: the count, the bytes and the time spent in them, beside the step's time. The model
is a random Llama made here with 12 heads and 6 KV heads (so 2 and 3 both divide them), SmolLM2-135M's other
shapes; correctness is the tests' (tests/workers/test_tensor_parallel.py), overhead is what this shows. No speed target
on CPU.

Modelled: the same count and bytes for a model and TP degree on a GPU fleet, against the link's bandwidth (a ring
all-reduce moves 2 (N-1)/N of the tensor per rank) and against the step's weight read at the HBM bandwidth
(tandem.planning.tp_comm; `tandem plan` does not use it yet).

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/tp.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.planning.tp_comm import GPUS, MODELS, decode_step_comm
from tandem.protocol import SamplingParams
from tandem.runtimes.launcher import free_port
from tandem.workers.engine.llm_engine import LLMEngine, load_engine_model
from tandem.workers.tensor_parallel import TPGroup, init_process_group, start_followers

SIZES = (1, 2, 3)
COLLECTIVES = ("all_reduce", "all_gather_last", "broadcast")


class Tally:
    """Collectives rank 0 ran: count, bytes (tensors' own; a broadcast's pickled inputs are not counted) and
    seconds, by kind."""

    def __init__(self):
        self.count: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self) -> None:
        for name in COLLECTIVES:
            original = getattr(TPGroup, name)

            def timed(group, value, _name=name, _original=original):
                started = time.perf_counter()
                result = _original(group, value)
                self.seconds[_name] += time.perf_counter() - started
                self.count[_name] += 1
                if isinstance(value, torch.Tensor):
                    self.bytes[_name] += value.numel() * value.element_size()
                return result

            setattr(TPGroup, name, timed)

    def reset(self) -> None:
        for table in (self.count, self.bytes, self.seconds):
            table.clear()


def make_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=768, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=12,
                         num_key_value_heads=6, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def run_size(model: str, size: int, tally: Tally, batch: int, decode_tokens: int) -> dict:
    config = EngineConfig(model=model, tensor_parallel_size=size, max_num_batched_tokens=512, num_kv_blocks=256)
    followers, group = [], None
    if size > 1:
        port = free_port()
        followers = start_followers(size, port, config.model_dump_json())
        group = init_process_group(0, size, port, torch.device("cpu"))
    try:
        engine = LLMEngine(load_engine_model(config, group), config)
        prompts = [[(17 * b + i) % 40000 + 100 for i in range(256)] for b in range(batch)]
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
        for b, prompt in enumerate(prompts):
            engine.add_request(f"r{b}", [t + 1 for t in prompt], params)  # +1: not the warm-up's cached prefix
        result, started, steps = {}, None, 0
        tally.reset()
        started = time.perf_counter()
        first = set()
        while len(first) < batch:  # the prefill steps: until every request has its first token
            first.update(out.request_id for out in engine.step() if out.new_token_ids)
            steps += 1
        result["prefill"] = (time.perf_counter() - started, steps, dict(tally.count), dict(tally.bytes),
                             dict(tally.seconds))
        tally.reset()
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():  # the decode steps: one token per sequence each
            engine.step()
            steps += 1
        result["decode"] = (time.perf_counter() - started, steps, dict(tally.count), dict(tally.bytes),
                            dict(tally.seconds))
        return result
    finally:
        if group is not None:
            group.broadcast(None)
            for follower in followers:
                follower.wait(60)
            dist.destroy_process_group()


def print_measured(results: dict[int, dict], batch: int) -> None:
    print(f"\nMeasured per engine step, rank 0 (batch {batch}; prefill: {batch} x 256-token prompts in 512-token "
          "steps; decode: one token per sequence per step)")
    print(f"{'TP':>3} {'phase':<8} {'step ms':>9} | " + " | ".join(f"{n:<28}" for n in COLLECTIVES))
    print(f"{'':>3} {'':<8} {'':>9} | " + " | ".join(f"{'count   KiB      ms':<28}" for _ in COLLECTIVES))
    for size, result in results.items():
        for phase in ("prefill", "decode"):
            seconds, steps, count, nbytes, spent = result[phase]
            steps = max(steps, 1)
            cells = [f"{count.get(n, 0) / steps:5.1f} {nbytes.get(n, 0) / steps / 1024:8.1f} "
                     f"{spent.get(n, 0) * 1000 / steps:8.2f}" for n in COLLECTIVES]
            print(f"{size:>3} {phase:<8} {seconds * 1000 / steps:9.1f} | " + " | ".join(f"{c:<28}" for c in cells))
    base = results[1]["decode"]
    for size, result in results.items():
        if size == 1:
            continue
        seconds, steps, _, _, spent = result["decode"]
        share = sum(spent.values()) / max(seconds, 1e-9)
        print(f"TP {size}: decode step {seconds / max(steps, 1) * 1000:.1f} ms vs TP 1 "
              f"{base[0] / max(base[1], 1) * 1000:.1f} ms ({base[0] / max(base[1], 1) / (seconds / max(steps, 1)):.2f}x "
              f"TP 1's speed); {share:.0%} of it in collectives")


def print_model() -> None:
    print("\nModelled: a decode step's all-reduces on a GPU fleet (ring all-reduce; bf16 activations), against the "
          "step's weight read")
    print(f"{'model':<14} {'GPU':<6} {'TP':>3} {'batch':>6} {'all-reduces':>11} {'MiB/rank':>9} {'comm us':>8} "
          f"{'weights us':>10} {'comm share':>10}")
    for model in MODELS.values():
        for gpu in GPUS.values():
            for tp in (2, 4, 8):
                for batch in (1, 64):
                    c = decode_step_comm(model, gpu, tp, batch)
                    print(f"{model.name:<14} {gpu.name:<6} {tp:>3} {batch:>6} {c.all_reduces:>11} "
                          f"{c.bytes_per_rank / 2**20:9.2f} {c.comm_s * 1e6:8.1f} {c.weights_s * 1e6:10.1f} "
                          f"{c.comm_s / (c.comm_s + c.weights_s):10.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 2, 8 decode steps")
    parser.add_argument("--model", help="a Llama checkpoint folder whose heads 2 and 3 divide (default: made here)")
    args = parser.parse_args(argv)
    batch, decode_tokens = (2, 8) if args.quick else (4, 32)
    os.environ["OMP_NUM_THREADS"] = "1"  # the followers' threads: each rank one, as one device each
    torch.set_num_threads(1)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"gloo; each rank 1 thread; python {sys.version.split()[0]}")
    tally = Tally()
    tally.wrap()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "llama-12h")
            make_model(model)
        results = {size: run_size(model, size, tally, batch, decode_tokens) for size in SIZES}
    print_measured(results, batch)
    print_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())
