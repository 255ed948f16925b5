"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, through the real
wrappers, and print one JSON line per compiled kernel: name, label, registers, stack bytes (spills) and
the tensor-core instructions in its SASS.

The interpreter accepts code that the compiler rejects (loop-carried type changes, unsupported ops), so
this is the only check of the GPU build a CPU-only CI gets. Run by test_compile_for_hopper.py in a
subprocess, because the kernels must be imported with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from tandem.workers.layers.metadata import AttentionMetadata

KERNEL_MODULES = ("paged_attention", "cache_write", "rmsnorm", "rope", "activation", "fp8", "fused_moe")
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _cuobjdump(*args: str) -> str:
    tool = os.path.join(TOOLS, "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


class _Hopper:
    """Just enough of a driver for JITFunction to compile: device 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def random_eager_step(rng, block_size: int = 16, hq: int = 32, hkv: int = 8, head_dim: int = 128):
    """(query, metadata) of one eager step as a serving engine forms them: 0-33 decodes of 1-6,000-token
    contexts and 0-2 prefill chunks of 2-600 tokens, some after a cached prefix. bf16, CPU tensors."""
    decodes = rng.choice([0, 1, 2, 3, 5, 8, 13, 16, 24, 33])
    prefills = rng.choice([0, 0, 1, 1, 2]) or (1 if decodes == 0 else 0)
    query_lens = [1] * decodes + [rng.randint(2, 600) for _ in range(prefills)]
    seq_lens = [rng.randint(1, 6000) for _ in range(decodes)]
    seq_lens += [q + rng.choice([0, 0, rng.randint(0, 3000)]) for q in query_lens[decodes:]]
    tokens = sum(query_lens)
    meta = AttentionMetadata(
        torch.zeros(tokens, dtype=torch.int64), torch.zeros(len(query_lens) + 1, dtype=torch.int32),
        torch.zeros(len(query_lens), dtype=torch.int32),
        torch.zeros(len(query_lens), max(-(-s // block_size) for s in seq_lens), dtype=torch.int32),
        query_lens, seq_lens, max(query_lens), max(seq_lens),
    )  # fmt: skip
    return torch.empty(tokens, hq, head_dim, dtype=torch.bfloat16), meta


def launch_as_on_a_gpu(pa, query, k_cache, v_cache, meta) -> None:
    """paged_attention with the split count it would pick on a GPU (on CPU tensors it picks 1); the caller stands
    in the SM count (pa._sm_count)."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    splits = pa.default_num_splits(query, k_cache.shape[2], meta, cuda)
    pa.paged_attention(query, k_cache, v_cache, meta, query.shape[2] ** -0.5, num_splits=splits)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET unset"
    driver.set_active(_Hopper())
    compiled: list[tuple[str, object]] = []
    reported: set[int] = set()
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        if id(kernel) not in reported:  # a launch that reuses an earlier build is not reported again
            reported.add(id(kernel))
            compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    modules = {name: importlib.import_module(f"tandem.workers.kernels.{name}") for name in KERNEL_MODULES}
    for module in modules.values():
        module.check_runnable = lambda *args: None  # CPU tensors stand in for CUDA ones: nothing is launched

    def report(label: str) -> None:
        for name, kernel in compiled:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(kernel.asm["cubin"])
                cubin.flush()
                usage = _cuobjdump("--dump-resource-usage", cubin.name)
                sass = _cuobjdump("-sass", cubin.name)
            print(
                json.dumps(
                    dict(
                        label=label,
                        kernel=name,
                        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                        tensor_core_ops=len(re.findall(r"\b(?:HMMA|HGMMA)\b", sass)),
                    )
                ),
                flush=True,
            )
        compiled.clear()

    def attention(label, query_lens, seq_lens, hq, hkv, d, block_size, dtype, num_splits=None, kv_dtype=None):
        blocks = max(-(-s // block_size) for s in seq_lens)
        kv_cache = torch.empty(4, 8, 2, block_size, hkv, d, dtype=kv_dtype or dtype)
        batch, tokens = len(seq_lens), sum(query_lens)
        meta = AttentionMetadata(
            torch.zeros(tokens, dtype=torch.int64),
            torch.zeros(batch + 1, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32),
            torch.zeros(batch, blocks, dtype=torch.int32),
            query_lens,
            seq_lens,
            max(query_lens),
            max(seq_lens),
        )
        query = torch.empty(tokens, hq, d, dtype=dtype)
        modules["paged_attention"].paged_attention(
            query, kv_cache[:, 3, 0], kv_cache[:, 3, 1], meta, d**-0.5, num_splits=num_splits, k_scale=0.5, v_scale=2.0
        )
        report(label)

    bf16 = torch.bfloat16
    # Eager decode steps whose batch size and block-table width fall in each of Triton's value classes (1, a
    # multiple of 16, other): one compiled kernel must serve them all, since each compile stalls a step.
    for batch, length in ((1, 16), (16, 256), (17, 272), (3, 300)):
        attention("decode, changing batch", [1] * batch, [length] * batch, 32, 8, 128, 16, bf16, num_splits=2)
    attention("decode", [1] * 64, [4096] * 64, 32, 8, 128, 16, bf16)
    attention("decode split-KV", [1] * 2, [4096] * 2, 32, 8, 128, 16, bf16, num_splits=8)
    attention("mixed prefill", [1, 512], [4096, 1024], 32, 8, 128, 16, bf16)
    attention("mixed prefill fp32", [1, 512], [4096, 1024], 32, 8, 128, 16, torch.float32)
    fp8_kv = torch.float8_e4m3fn  # --kv-cache-dtype fp8: bf16 queries over an e4m3 cache
    attention("decode fp8 KV", [1] * 64, [4096] * 64, 32, 8, 128, 16, bf16, kv_dtype=fp8_kv)
    attention("decode split-KV fp8 KV", [1] * 2, [4096] * 2, 32, 8, 128, 16, bf16, num_splits=8, kv_dtype=fp8_kv)
    attention("mixed prefill fp8 KV", [1, 512], [4096, 1024], 32, 8, 128, 16, bf16, kv_dtype=fp8_kv)

    kv_cache = torch.empty(4, 8, 2, 16, 8, 128, dtype=bf16)
    key = torch.empty(64, 8, 128, dtype=bf16)
    slots = torch.zeros(64, dtype=torch.int64)
    modules["cache_write"].write_kv_cache(key, key, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots)
    fp8_cache = torch.empty(4, 8, 2, 16, 8, 128, dtype=fp8_kv)
    modules["cache_write"].write_kv_cache(key, key, fp8_cache[:, 1, 0], fp8_cache[:, 1, 1], slots, 0.5, 2.0)
    x, weight = torch.empty(64, 4096, dtype=bf16), torch.empty(4096, dtype=bf16)
    modules["rmsnorm"].rms_norm(x, weight, 1e-5)
    modules["rmsnorm"].fused_add_rms_norm(x, x.clone(), weight, 1e-5)
    qkv = torch.empty(64, 48 * 128, dtype=bf16)
    q, k = qkv[:, :4096].view(64, 32, 128), qkv[:, 4096:5120].view(64, 8, 128)
    modules["rope"].apply_rotary(torch.zeros(64, dtype=torch.int64), q, k, torch.empty(100, 128))
    modules["activation"].silu_and_mul(torch.empty(64, 2 * 14336, dtype=bf16))
    report("elementwise")

    fp8 = modules["fp8"]
    fp8.quantize_rows(torch.empty(64, 4096, dtype=bf16))
    weight, scales = torch.empty(6144, 4096, dtype=fp8.FP8), torch.empty(6144)
    for rows in (1, 64):
        fp8.fp8_weight_gemm(torch.empty(rows, 4096, dtype=bf16), weight, scales, torch.empty(6144, dtype=bf16))
    report("fp8")

    moe = modules["fused_moe"]  # Mixtral-8x7B's expert shapes, a decode batch and a prefill chunk
    w13, w2 = torch.empty(8, 2 * 14336, 4096, dtype=bf16), torch.empty(8, 4096, 14336, dtype=bf16)
    for tokens in (4, 512):
        ids = torch.arange(2 * tokens).remainder(8).view(tokens, 2)
        moe.fused_moe(torch.empty(tokens, 4096, dtype=bf16), w13, w2, torch.empty(tokens, 2, dtype=bf16), ids)
    report("fused moe")

    # After compile_eager_builds, the eager steps a server forms compile nothing more.
    pa = modules["paged_attention"]
    pa._sm_count = lambda device: 132
    kv_cache = torch.empty(4, 2, 2, 16, 8, 128, dtype=bf16)
    pa.compile_eager_builds(kv_cache[:, 1, 0], kv_cache[:, 1, 1], 32)
    compiled.clear()
    rng = random.Random(0)
    for _ in range(60):
        query, meta = random_eager_step(rng)
        launch_as_on_a_gpu(pa, query, kv_cache[:, 1, 0], kv_cache[:, 1, 1], meta)
    print(json.dumps(dict(label="eager steps after compile_eager_builds", new_builds=[n for n, _ in compiled])))


if __name__ == "__main__":
    main()
