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
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from tandem.workers.layers.metadata import AttentionMetadata

KERNEL_MODULES = ("paged_attention", "cache_write", "rmsnorm", "rope", "activation")
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


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET unset"
    driver.set_active(_Hopper())
    compiled: list[tuple[str, object]] = []
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
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

    def attention(label, query_lens, seq_lens, hq, hkv, d, block_size, dtype, num_splits=None):
        blocks = max(-(-s // block_size) for s in seq_lens)
        kv_cache = torch.empty(4, 8, 2, block_size, hkv, d, dtype=dtype)
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
            query, kv_cache[:, 3, 0], kv_cache[:, 3, 1], meta, d**-0.5, num_splits=num_splits
        )
        report(label)

    bf16 = torch.bfloat16
    attention("decode", [1] * 64, [4096] * 64, 32, 8, 128, 16, bf16)
    attention("decode split-KV", [1] * 2, [4096] * 2, 32, 8, 128, 16, bf16, num_splits=8)
    attention("mixed prefill", [1, 512], [4096, 1024], 32, 8, 128, 16, bf16)
    attention("mixed prefill fp32", [1, 512], [4096, 1024], 32, 8, 128, 16, torch.float32)

    kv_cache = torch.empty(4, 8, 2, 16, 8, 128, dtype=bf16)
    key = torch.empty(64, 8, 128, dtype=bf16)
    slots = torch.zeros(64, dtype=torch.int64)
    modules["cache_write"].write_kv_cache(key, key, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots)
    x, weight = torch.empty(64, 4096, dtype=bf16), torch.empty(4096, dtype=bf16)
    modules["rmsnorm"].rms_norm(x, weight, 1e-5)
    modules["rmsnorm"].fused_add_rms_norm(x, x.clone(), weight, 1e-5)
    qkv = torch.empty(64, 48 * 128, dtype=bf16)
    q, k = qkv[:, :4096].view(64, 32, 128), qkv[:, 4096:5120].view(64, 8, 128)
    modules["rope"].apply_rotary(torch.zeros(64, dtype=torch.int64), q, k, torch.empty(100, 128))
    modules["activation"].silu_and_mul(torch.empty(64, 2 * 14336, dtype=bf16))
    report("elementwise")


if __name__ == "__main__":
    main()
