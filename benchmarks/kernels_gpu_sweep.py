"""Launch configurations of the paged attention kernel, swept on a CUDA GPU.

For each shape, every configuration's time (triton.testing.do_bench median) next to the one the kernel's
own _tile_config picks, with each output's largest difference from the picked configuration's output (a
configuration that computes something else is flagged, not timed as a win):
  prefill 1 x 4096          one long causal prefill (kernels_gpu.py (d))
  prefill 16 x 512          the engine's 8,192-token step of 512-token prompts (engine_gpu.py (b)'s prefill)
  decode 64 x 4096          decode tiles (kernels_gpu.py (b))
  decode 1 x 32768 splits   batch-1 long-context decode, split counts forced
Prints a table per shape; never asserts. Shapes and dtype as benchmarks/kernels_gpu.py (Llama-3-8B layer, bf16).

    PYTHONSAFEPATH=1 python3 benchmarks/kernels_gpu_sweep.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import HEAD_DIM, HKV, HQ, attention_bytes, paged_setup  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels_gpu_sweep.py needs a CUDA GPU, and torch sees none.")
    from triton.testing import do_bench

    from tandem.workers.kernels import paged_attention as pa

    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    picked_config = pa._tile_config
    print(f"device {torch.cuda.get_device_name(device)}; {HQ} query / {HKV} KV heads, head dim {HEAD_DIM}, bf16")

    def run(query, k_cache, v_cache, meta, config=None, num_splits=None):
        pa._tile_config = picked_config if config is None else (lambda *a, **k: dict(config))
        try:
            return pa.paged_attention(query, k_cache, v_cache, meta, scale, num_splits=num_splits)
        finally:
            pa._tile_config = picked_config

    def sweep(label, query_lens, seq_lens, configs, flops=None, splits=(None,)):
        query, k_cache, v_cache, meta = paged_setup(query_lens, seq_lens, 16, 4, device)
        reference = run(query, k_cache, v_cache, meta).float()
        picked = picked_config(meta.max_query_len, HQ // HKV, HEAD_DIM, query.dtype)
        print(f"\n{label}: picked {picked}")
        rows = []
        for config, num_splits in itertools.product([None, *configs], splits):
            try:
                out = run(query, k_cache, v_cache, meta, config, num_splits).float()
                diff = (out - reference).abs().max().item()
                ms = do_bench(lambda c=config, s=num_splits: run(query, k_cache, v_cache, meta, c, s),
                              warmup=10, rep=100, return_mode="median")
            except Exception as exc:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  {config} splits={num_splits}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                continue
            rate = (f"{flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s" if flops else
                    f"{attention_bytes(query_lens, seq_lens) / (ms * 1e-3) / 1e12:5.2f} TB/s")
            rows.append((ms, config, num_splits, diff, rate))
        for ms, config, num_splits, diff, rate in sorted(rows, key=lambda r: r[0]):
            flag = "" if diff < 0.06 else "  <- differs"
            name = "picked" if config is None else config
            print(f"  {ms * 1e3:9.1f} us {rate}  splits={num_splits}  max|diff| {diff:.4f}  {name}{flag}")
        sys.stdout.flush()

    prefill = [dict(BLOCK_M=m, BLOCK_Q=m // (HQ // HKV), TILE_N=n, num_warps=w, num_stages=s)
               for m, n, (w, s) in itertools.product((64, 128), (32, 64, 128), ((4, 2), (8, 2), (8, 3)))]
    causal = lambda n: 4 * HQ * HEAD_DIM * (n * (n + 1) // 2)  # noqa: E731
    sweep("prefill 1 x 4096", [4096], [4096], prefill, flops=causal(4096))
    sweep("prefill 16 x 512", [512] * 16, [512] * 16, prefill, flops=16 * causal(512))
    decode = [dict(BLOCK_M=16, BLOCK_Q=1, TILE_N=n, num_warps=w, num_stages=s)
              for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3))]
    sweep("decode 64 x 4096", [1] * 64, [4096] * 64, decode)
    sweep("decode 1 x 32768", [1], [32768], [], splits=(None, 8, 16, 32, 64, 128))
    sweep("decode 256 x 640 (engine_gpu.py (b)'s decode steps)", [1] * 256, [640] * 256, decode[:9],
          splits=(None, 1, 2))


if __name__ == "__main__":
    main()
