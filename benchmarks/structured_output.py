"""What a structured output costs a decode step: the same requests with and without a grammar, in one run.

SmolLM2 (the packaged GGUF) in one engine, as a worker runs it (CPU, or the GPU when one is present). For
batches of 1, 16 and 64 requests (one chat prompt each, greedy, --tokens new tokens):
  free       : no constraint (ignore_eos, so every request makes all its tokens);
  structured : each held to a JSON schema (an array of at least 1,000 strings, so that no request ends before
               its tokens are out and both runs take the same steps).
Per run: the median wall time of a decode step (the first step, which prefills, left out), the ratio
structured / free, and the time the grammar masks took within a structured step (GrammarMatchers.allowed:
llguidance's masks for the grammar rows, unpacked to a [rows, vocab] tensor on the device). Also the one-off cost
at the first structured request: llguidance's view of the tokenizer and the grammar's compilation.
Prints conditions and figures; asserts nothing.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/structured_output.py [--tokens 64] [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from tandem.config import EngineConfig
from tandem.openai.structured_output import json_schema_spec
from tandem.protocol import SamplingParams
from tandem.workers.engine.grammar import GrammarMatchers
from tandem.workers.engine.llm_engine import LLMEngine

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
PROMPT = "List the names of as many rivers as you know, as a JSON array of strings."


def step_times(engine: LLMEngine, prompt: list[int], params: SamplingParams, batch: int) -> list[float]:
    """Wall seconds of each decode step of `batch` requests run together (the prefill step left out)."""
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    args = ap.parse_args()

    engine = LLMEngine.from_config(EngineConfig(model="smollm2", num_kv_blocks=2048, max_num_seqs=256))
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                            add_generation_prompt=True), add_special_tokens=False)
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    structured = free.model_copy(update={"structured": json_schema_spec(SCHEMA)})

    start = time.perf_counter()
    engine.grammars.start(structured.structured, [])
    first_use_s = time.perf_counter() - start

    # The masks' share of a step: GrammarMatchers.allowed, timed where the engine calls it.
    mask_seconds: list[float] = []
    allowed = GrammarMatchers.allowed

    def timed_allowed(self, matchers, device):
        t = time.perf_counter()
        out = allowed(self, matchers, device)
        if out[1].is_cuda:
            torch.cuda.synchronize()
        mask_seconds.append(time.perf_counter() - t)
        return out

    GrammarMatchers.allowed = timed_allowed

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}, device {engine.runner.device}, "
          f"{os.cpu_count()} logical CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {len(prompt)}-token prompt, {args.tokens} new tokens per request, greedy; schema {SCHEMA}")
    print(f"# first structured request: llguidance tokenizer + grammar compile {first_use_s * 1e3:.0f} ms (once)")
    print("| batch | free ms/step | structured ms/step | structured / free | masks ms/step | masks' share |")
    print("|---|---|---|---|---|---|")
    step_times(engine, prompt, free, 1)  # warm-up
    for batch in [int(b) for b in args.batches.split(",")]:
        plain = statistics.median(step_times(engine, prompt, free, batch))
        mask_seconds.clear()
        held = statistics.median(step_times(engine, prompt, structured, batch))
        masks = statistics.median(mask_seconds[1:])
        print(f"| {batch} | {plain * 1e3:.2f} | {held * 1e3:.2f} | {held / plain:.2f}x | {masks * 1e3:.2f} | "
              f"{masks / held:.0%} |")
    one = engine.generate([prompt], structured)[0]
    print(f"# a structured answer's start: {one.text[:80]!r}")


if __name__ == "__main__":
    main()
