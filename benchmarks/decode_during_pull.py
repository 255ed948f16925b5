"""What a KV pull costs the requests a decode worker is already running, same run.

Two SmolLM2 engines in this process, as a prefill and a decode worker (the KV cache moves between them over a real
transfer backend, --backend nixl or tcp). The decode engine runs --running greedy requests; once they are decoding,
a disaggregated request arrives whose --tokens-token prompt the prefill engine has computed, and its KV is pulled.
Printed per backend: a decode step's median time before the pull (the reference), the pull's own time, and the
longest gap between two tokens of a running request while the pull lasted, two ways in the same run:
  beside the steps     : the engine with kv_pull_in_background "on" (the pull on a thread of its own);
  on the engine thread : the same read done between two steps, as kv_pull_in_background "off" does.
On a GPU the read is the NIC's or NVLink's work and the steps can go on beside it; on a CPU-only host the copy
takes CPU time from the steps (a pull moves bytes with the cores the forward pass computes with). "auto" pulls in
the background on a GPU only, from these figures.
Prints conditions and figures; asserts nothing.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/decode_during_pull.py [--tokens 2000] [--running 8] [--backend tcp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time

import torch
from prometheus_client import CollectorRegistry

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine, RemoteKV, load_engine_model
from tandem.workers.kv_transfer import create_kv_transfer

LABELS = {"model": "smollm2", "pool": "decode"}
GREEDY = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(length)]


def measure(backend: str, loaded, args) -> None:
    config = EngineConfig(model="smollm2", num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048,
                          kv_pull_in_background="on")
    registry = CollectorRegistry()
    prefill, decode = LLMEngine(loaded, config), LLMEngine(loaded, config, EngineMetrics(**LABELS, registry=registry))
    prefill.kv_transfer = create_kv_transfer(backend, prefill.runner.kv_cache, f"prefill-{backend}")
    decode.kv_transfer = create_kv_transfer(backend, decode.runner.kv_cache, f"decode-{backend}")
    try:
        prompt = prompt_of(args.tokens, seed=1)
        prefill.add_request("arriving", prompt, GREEDY, prefill_only=True)
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                if out.kv_lease is not None:
                    first, lease = out.new_token_ids[0], out.kv_lease
        source = RemoteKV(prefill.kv_transfer.agent_info(), lease.block_ids, lease.expires_at)

        for i in range(args.running):
            decode.add_request(f"running-{i}", prompt_of(64, seed=10 + i), GREEDY)
        token_times: list[float] = []  # when the first running request got each token

        def step() -> list:
            outs = decode.step()
            if any(out.request_id == "running-0" for out in outs):
                token_times.append(time.perf_counter())
            return outs

        def gaps_from(start: int) -> list[float]:
            return [b - a for a, b in zip(token_times[start - 1:], token_times[start:])]

        for _ in range(args.warmup_steps):
            step()
        reference = statistics.median(gaps_from(len(token_times) - 8))

        # Beside the steps: the engine's own path.
        before = len(token_times)
        decode.add_request("arriving", prompt, GREEDY.model_copy(update={"max_tokens": 2}), first_token_id=first,
                           kv_source=source)
        status = None
        while status is None:
            for out in step():
                if out.request_id == "arriving":
                    status = out.kv_status
        step()
        beside = max(gaps_from(before))
        pull_s = registry.get_sample_value("tandem_kv_transfer_seconds_sum", LABELS)

        # On the engine thread, between two steps, as the engine pulled before: the same read into free blocks.
        for _ in range(3):
            step()
        pool = decode.block_manager.pool
        local = [pool.allocate() for _ in lease.block_ids]
        before = len(token_times)
        step()
        started = time.perf_counter()
        decode.kv_transfer.read_blocks(source.agent_info, lease.block_ids, local, config.kv_pull_timeout_s)
        inline_s = time.perf_counter() - started
        step()
        step()
        inline = max(gaps_from(before))
        pool.free_all(local)
        print(f"| {backend} | {args.running} | {reference * 1e3:.1f} | {pull_s * 1e3:.1f} / {inline_s * 1e3:.1f} | "
              f"{beside * 1e3:.1f} ({beside / reference:.2f}x) | {inline * 1e3:.1f} ({inline / reference:.2f}x) | "
              f"{status} |")
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="the arriving request's prompt length")
    ap.add_argument("--running", type=int, default=8, help="requests decoding when it arrives")
    ap.add_argument("--warmup-steps", type=int, default=12)
    ap.add_argument("--backend", nargs="+", default=["tcp", "nixl"])
    args = ap.parse_args()
    loaded = load_engine_model(EngineConfig(model="smollm2"))
    kv_bytes = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}, {os.cpu_count()} logical CPUs, torch "
          f"{torch.__version__}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {args.tokens}-token prompt pulled ({args.tokens * kv_bytes / 2**20:.0f} MiB of float32 KV) while "
          f"{args.running} requests decode")
    print("| backend | running | decode step (ms) | pull beside / on the engine thread (ms) | longest gap, pull "
          "beside the steps (ms, / step) | longest gap, pull on the engine thread (ms, / step) | status |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backend:
        measure(backend, loaded, args)


if __name__ == "__main__":
    main()
