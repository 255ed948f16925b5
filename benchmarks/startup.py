"""How long a worker and a router take to start: what a pod restart, a scale-up or `tandem serve` waits for.

In one run, on this machine:
  GGUF read   : opening the model file and reading its metadata (SmolLM2: a 49,152-token vocabulary and its
                merges) with gguf-py's own GGUFReader, against tandem.gguf_file.open_gguf (the same reader over a
                plain ndarray view of its memory map); interleaved, best and median of --repeats each.
  tokenizer   : tandem.tokenizer.load_tokenizer, what a router loads (the GGUF read above, then the BPE built).
  model       : tandem.workers.models.loader.load_model on the CPU: weights dequantized, tokenizer, config.
  worker      : `tandem worker` from its start to its /ready answering 200 (imports, kernels, model, KV cache).
  router      : `tandem router` from its start to /ready answering 200, its worker already serving.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/startup.py [--model smollm2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from importlib.metadata import version

import gguf

from tandem.gguf_file import open_gguf
from tandem.model_source import resolve_model_source
from tandem.runtimes.launcher import ServiceProcess
from tandem.tokenizer import load_tokenizer
from tandem.workers.models.loader import load_model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(seconds: list[float]) -> str:
    return f"best {min(seconds):6.2f} s   median {statistics.median(seconds):6.2f} s"


def process_start(args: list[str], name: str) -> tuple[float, ServiceProcess]:
    start = time.perf_counter()
    proc = ServiceProcess(args, name=name).start()
    proc.wait_ready(600)
    return time.perf_counter() - start, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model_source(args.model)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; gguf {version('gguf')}; "
          f"model {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.0f} MiB)")

    theirs, ours = [], []
    for _ in range(args.repeats):
        theirs.append(timed(lambda: gguf.GGUFReader(path)))
        ours.append(timed(lambda: open_gguf(path)))
    print(f"GGUF read, gguf.GGUFReader       : {summary(theirs)}")
    print(f"GGUF read, tandem open_gguf      : {summary(ours)}   ({min(theirs) / min(ours):.2f}x faster, best)")

    print(f"tokenizer (load_tokenizer)       : "
          f"{summary([timed(lambda: load_tokenizer(args.model)) for _ in range(args.repeats)])}")
    print(f"model on the CPU (load_model)    : "
          f"{summary([timed(lambda: load_model(args.model)) for _ in range(args.repeats)])}")

    workers, routers = [], []
    for _ in range(args.repeats):
        seconds, worker = process_start(["worker", "--model", args.model, "--kv-transfer", "tcp",
                                         "--num-kv-blocks", "512", "--log-level", "warning"], "startup-worker")
        workers.append(seconds)
        try:
            seconds, router = process_start(["router", "--model", args.model, "--decode", worker.url,
                                             "--log-level", "warning"], "startup-router")
            routers.append(seconds)
            router.stop()
        finally:
            worker.stop()
    print(f"worker process to /ready         : {summary(workers)}   (--num-kv-blocks 512)")
    print(f"router process to /ready         : {summary(routers)}   (its worker already serving)")


if __name__ == "__main__":
    main()
