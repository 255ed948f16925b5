"""Every kernel builds for sm_90 (H100/H200) through its real wrapper, even on a machine without a GPU,
and the attention kernel's GPU build keeps its accumulators in registers (no spills) and runs its dots
on tensor cores. (With a GPU present the @gpu tests compile and run the kernels for real.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

SCRIPT = os.path.join(os.path.dirname(__file__), "hopper_compile_check.py")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.fixture(scope="module")
def builds() -> list[dict]:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the @gpu tests compile and run the kernels")
    if not os.path.exists(PTXAS):
        pytest.skip("this triton install has no NVIDIA backend tools (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONSAFEPATH"] = "1"
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_builds(builds):
    built = {b["kernel"] for b in builds if "kernel" in b}
    assert built == {
        "_paged_attention_kernel",
        "_merge_splits_kernel",
        "_write_kv_cache_kernel",
        "_rms_norm_kernel",
        "_fused_add_rms_norm_kernel",
        "_rope_kernel",
        "_silu_and_mul_kernel",
        "_quantize_rows_kernel",
        "_fp8_weight_gemm_kernel",
        "_grouped_gemm_kernel",
    }


def test_the_fp8_weight_gemm_uses_tensor_cores_without_spilling(builds):
    gemms = [b for b in builds if b.get("kernel") == "_fp8_weight_gemm_kernel"]
    assert len(gemms) == 2  # one build per row tile: decode-sized (16 rows) and larger (64)
    for build in gemms:
        assert build["stack"] == 0 and build["tensor_core_ops"] > 0, build


def test_the_fused_moe_gemm_uses_tensor_cores_without_spilling(builds):
    gemms = [b for b in builds if b.get("kernel") == "_grouped_gemm_kernel"]
    assert gemms
    for build in gemms:
        assert build["stack"] == 0 and build["tensor_core_ops"] > 0, build


def test_attention_builds_do_not_spill(builds):
    attention = [b for b in builds if b.get("kernel") == "_paged_attention_kernel"]
    assert len(attention) == 8  # 5 over float caches, 3 over FP8 ones
    for build in attention:
        assert build["stack"] == 0, f"{build['label']}: {build['stack']} bytes of register spills"


def test_bf16_attention_uses_tensor_cores(builds):
    for build in builds:
        if build.get("kernel") == "_paged_attention_kernel" and "fp32" not in build["label"]:
            assert build["tensor_core_ops"] > 0, build


def test_fp8_kv_cache_builds(builds):
    """--kv-cache-dtype fp8: the attention kernel over an e4m3 cache (decode, split-KV, prefill) and the quantizing
    cache write build for sm_90; the attention keeps its dots on tensor cores."""
    fp8 = [b for b in builds if "fp8 KV" in b["label"] and b.get("kernel") == "_paged_attention_kernel"]
    assert len(fp8) == 3 and all(b["tensor_core_ops"] > 0 and b["stack"] == 0 for b in fp8), fp8
    writes = [b for b in builds if b.get("kernel") == "_write_kv_cache_kernel"]
    assert len(writes) == 2 and all(b["stack"] == 0 for b in writes), writes  # float and FP8 caches


def test_changing_batch_sizes_and_table_widths_reuse_one_attention_build(builds):
    """The script reports each build once, when first compiled: four decode steps of 1, 16, 17 and 3 sequences
    with tables 1, 16, 17 and 19 blocks wide must compile the attention kernel once."""
    changing = [b.get("kernel") for b in builds if b["label"] == "decode, changing batch"]
    assert changing.count("_paged_attention_kernel") == 1, changing


def test_eager_steps_compile_nothing_after_compile_eager_builds(builds):
    """ModelRunner calls compile_eager_builds at start on a GPU: 60 random eager steps (decodes of changing
    batch and context, prefill chunks, split counts from the heuristic) then find every build ready."""
    (after,) = [b for b in builds if b["label"] == "eager steps after compile_eager_builds"]
    assert after["new_builds"] == []
