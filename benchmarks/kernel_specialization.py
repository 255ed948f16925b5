"""What not specializing the attention kernel on the batch size and the block table's stride changes in its code.

619965a stopped Triton from specializing `_paged_attention_kernel` on `num_seqs` and `stride_bt` (each value class
compiled a build of its own, on a serving step). This script compiles the kernel as served and a copy specialized
again, for an H100/H200 (sm_90) through the compile check's stand-in driver (no GPU: Triton's own ptxas does the
work), on two launches: batch-1 decode at a long context with the split count a 132-SM device picks, and a batched
decode. It prints, for each build, its SASS instruction count and its global loads by kind. It says nothing about
time: benchmarks/kernels_gpu.py times both on a GPU.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kernel_specialization.py
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET unset: this script compiles the kernels")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tandem-specialization-")
    import torch
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "workers", "kernels"))
    from hopper_compile_check import _cuobjdump, _Hopper

    from tandem.workers.kernels import paged_attention as pa
    from tandem.workers.layers.metadata import AttentionMetadata

    driver.set_active(_Hopper())
    compiled: list[tuple[str, object]] = []
    original_run = JITFunction.run

    def compile_only(self, *launch_args, grid, warmup, **kwargs):
        kernel = original_run(self, *launch_args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    pa.check_runnable = lambda *a: None  # CPU tensors stand in for CUDA ones: nothing is launched
    block_size, kv_heads, head_dim = 16, 8, 128

    def launch(batch: int, context: int, splits: int) -> str:
        kv = torch.empty(4, 4, 2, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
        meta = AttentionMetadata(
            torch.zeros(batch, dtype=torch.int64), torch.zeros(batch + 1, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, context // block_size, dtype=torch.int32),
            [1] * batch, [context] * batch, 1, context,
        )  # fmt: skip
        query = torch.empty(batch, 32, head_dim, dtype=torch.bfloat16)
        compiled.clear()
        pa.paged_attention(query, kv[:, 3, 0], kv[:, 3, 1], meta, head_dim**-0.5, num_splits=splits)
        (kernel,) = [k for name, k in compiled if name == "_paged_attention_kernel"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            return _cuobjdump("-sass", cubin.name)

    print(f"triton {triton.__version__}, sm_90; Llama-3-8B layer shape (32 query / 8 KV heads, head dim 128), bf16")
    served = pa._paged_attention_kernel
    for label, kernel in (("served (num_seqs, stride_bt not specialized)", served),
                          ("specialized again", triton.jit(served.fn))):
        pa._paged_attention_kernel = kernel
        try:
            for batch, context, splits in ((1, 32768, 32), (64, 4096, 1)):
                sass = launch(batch, context, splits)
                instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))
                loads = collections.Counter(re.findall(r"\b(LDG\.E[.A-Z0-9]*|LDGSTS[.A-Z0-9]*)\b", sass))
                print(f"{label}: decode {batch} x {context}, {splits} split(s): {instructions} instructions; "
                      f"loads {dict(sorted(loads.items()))}")
        finally:
            pa._paged_attention_kernel = served


if __name__ == "__main__":
    main()
