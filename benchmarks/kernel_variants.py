"""How many builds of the attention kernel a stream of eager steps compiles, and the compile time they take.

Each distinct build is compiled on first use, on the engine's thread: a serving GPU worker's step stalls for
as long (about a second each). Decode-only steps of up to 256 sequences replay CUDA graphs captured at start;
prefill and mixed steps, and larger decode batches, run eagerly with whatever batch the scheduler formed.
This script draws --steps such eager steps at random (0-33 decodes of 1-6,000-token contexts, 0-2 prefill
chunks of 2-600 tokens, some after a cached prefix) and launches the attention kernel for each exactly as
the engine does (split count from choose_num_splits on a 132-SM device), compiling for an H100/H200 (sm_90)
through a stand-in driver: no GPU is needed (Triton's own ptxas does the work). A fresh Triton cache each run
times the compiles.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kernel_variants.py [--steps 100] [--seed 0]
        [--after-compile-eager-builds]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--after-compile-eager-builds", action="store_true",
                    help="first run what a GPU worker runs at start (paged_attention.compile_eager_builds)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET unset: this script compiles the kernels")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tandem-variants-")
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "workers", "kernels"))
    # The compile test's stand-in sm_90 driver, its server-like eager steps and its GPU-like launch.
    from hopper_compile_check import _Hopper, launch_as_on_a_gpu, random_eager_step

    from tandem.workers.kernels import paged_attention as pa

    driver.set_active(_Hopper())
    builds: dict[str, list[float]] = {}  # kernel name -> compile seconds of each new build
    seen: set[int] = set()
    original_run = JITFunction.run

    def compile_only(self, *launch_args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = original_run(self, *launch_args, grid=grid, warmup=True, **kwargs)
        if id(kernel) not in seen:
            seen.add(id(kernel))
            builds.setdefault(self.fn.__name__, []).append(time.perf_counter() - start)
        return kernel

    JITFunction.run = compile_only
    pa.check_runnable = lambda *a: None  # CPU tensors stand in for CUDA ones: nothing is launched
    pa._sm_count = lambda device: 132
    kv_cache = torch.empty(4, 2, 2, 16, 8, 128, dtype=torch.bfloat16)
    if args.after_compile_eager_builds:
        start = time.perf_counter()
        launches = pa.compile_eager_builds(kv_cache[:, 1, 0], kv_cache[:, 1, 1], 32)
        print(f"compile_eager_builds: {launches} launches, {sum(len(b) for b in builds.values())} builds, "
              f"{time.perf_counter() - start:.1f} s (what a GPU worker does at start); then the steps:")
        builds.clear()
    rng = random.Random(args.seed)
    for _ in range(args.steps):
        query, meta = random_eager_step(rng)
        launch_as_on_a_gpu(pa, query, kv_cache[:, 1, 0], kv_cache[:, 1, 1], meta)
    print(f"{args.steps} random eager steps (seed {args.seed}), Llama-3-8B attention layer, bf16, compiled for sm_90:")
    for name, compiled in builds.items():
        print(f"  {name}: {len(compiled)} builds, {sum(compiled):.1f} s of compiling on this host")
    if not builds:
        print("  no new builds")


if __name__ == "__main__":
    main()
