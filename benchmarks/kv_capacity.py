"""KV cache capacity with --kv-cache-dtype fp8 against auto: blocks (and 2,048-token sequences) that fit in a fixed
--kv-cache-memory-gb, for SmolLM2-135M's and Llama-3-8B's shapes, each model dtype; and on the CPU, what reading an
FP8 cache costs a decode step's attention (the torch path, which dequantizes what it gathers).

Capacities come from the engine's own accounting (model_runner.kv_cache_blocks); SmolLM2's cache is also allocated
to check its bytes. Never asserts.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kv_capacity.py [--memory-gb 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_gpu as bench  # noqa: E402  (Llama-3-8B's config)

from tandem.config import EngineConfig  # noqa: E402
from tandem.workers.engine.model_runner import ModelRunner, kv_cache_blocks  # noqa: E402
from tandem.workers.layers import attention, kv_quant  # noqa: E402
from tandem.workers.layers.metadata import AttentionMetadata  # noqa: E402
from tandem.workers.models.config import ModelConfig  # noqa: E402
from tandem.workers.models.loader import load_engine_config  # noqa: E402

SEQ_TOKENS = 2048


@functools.cache
def smollm2_config() -> ModelConfig:
    """SmolLM2-135M's architecture, read from the packaged GGUF without its weights."""
    return load_engine_config("smollm2")


def loaded(config: ModelConfig, dtype: torch.dtype):
    return types.SimpleNamespace(model=None, config=config, tokenizer=None, dtype=dtype, device=torch.device("cpu"))


def capacity(memory_gb: float) -> None:
    print(f"\n(a) KV capacity at --kv-cache-memory-gb {memory_gb} (block size 16; sequences of {SEQ_TOKENS} tokens)")
    print(f"{'model':<12} {'dtype':<9} {'kv-cache-dtype':<15} {'blocks':>9} {'sequences':>10} {'vs auto':>8}")
    for name, config in (("SmolLM2", smollm2_config()), ("Llama-3-8B", bench.llama3_8b_config())):
        for dtype in (torch.bfloat16, torch.float32):
            auto = None
            for kv in ("auto", "fp8"):
                blocks = kv_cache_blocks(loaded(config, dtype), EngineConfig(kv_cache_memory_gb=memory_gb,
                                                                              kv_cache_dtype=kv))
                auto = auto or blocks
                print(f"{name:<12} {str(dtype)[6:]:<9} {kv:<15} {blocks:>9,} {blocks * 16 // SEQ_TOKENS:>10,} "
                      f"{blocks / auto:>7.2f}x")
    runner = ModelRunner(loaded(smollm2_config(), torch.bfloat16), EngineConfig(kv_cache_memory_gb=0.25,
                                                                                kv_cache_dtype="fp8"))
    print(f"allocated check: SmolLM2 bf16 model, fp8 KV at 0.25 GiB: {runner.num_blocks:,} blocks, "
          f"{runner.kv_cache.nbytes / 2**20:.1f} MiB, {runner.kv_cache.dtype}")


def decode_attention_cost(batch: int, context: int, repeats: int) -> None:
    config = smollm2_config()
    heads, kv_heads, dim, block = config.num_heads, config.num_kv_heads, config.head_dim, 16
    blocks = batch * context // block
    print(f"\n(b) one layer's decode attention on the CPU, torch path: SmolLM2's heads ({heads} q, {kv_heads} kv, "
          f"dim {dim}), batch {batch}, context {context}, float32 queries, {torch.get_num_threads()} threads")
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    meta = AttentionMetadata(torch.zeros(batch, dtype=torch.int64), torch.arange(batch + 1, dtype=torch.int32),
                             torch.full((batch,), context, dtype=torch.int32), tables, [1] * batch, [context] * batch,
                             1, context)
    query = torch.randn(batch, heads, dim)
    float_cache = torch.randn(blocks, block, kv_heads, dim)
    base = None
    for label, cache in (("float32 cache", float_cache), ("fp8 cache", kv_quant.quantize(float_cache, 1.0))):
        attention.paged_attention(query, cache, cache, meta, dim**-0.5)
        started = time.perf_counter()
        for _ in range(repeats):
            attention.paged_attention(query, cache, cache, meta, dim**-0.5)
        seconds = (time.perf_counter() - started) / repeats
        base = base or seconds
        print(f"{label:<14} {seconds * 1e3:8.3f} ms  ({seconds / base:.2f}x)  cache bytes read "
              f"{cache.nbytes / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gb", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    capacity(args.memory_gb)
    decode_attention_cost(args.batch, args.context, args.repeats)


if __name__ == "__main__":
    main()
