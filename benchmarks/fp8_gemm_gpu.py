"""FP8 GEMMs of a decode step alone, on a CUDA GPU: Llama-3-8B's four GEMM shapes at 1 and 16 rows, as bytes of
weight read per second against the device's copy bandwidth. Peers in the same run: the BF16 GEMM (F.linear), and
torch._scaled_mm with the activations quantized per token (what `--quantization fp8` runs on FP8 tensor cores);
the weight-only Triton GEMM (tandem.workers.kernels.fp8) at each launch configuration of a small sweep.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/fp8_gemm_gpu.py
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
           for n, k, w, s in itertools.product((16, 32, 64), (256, 512), (4,), (3, 5))]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_gemm_gpu.py needs a CUDA GPU")
    from triton.testing import do_bench

    from tandem.workers.kernels.fp8 import fp8_weight_gemm
    from tandem.workers.layers.fp8_linear import fp8_linear, quantize_weight, scaled_mm_supported

    def seconds(fn, *args, **kwargs) -> float:
        return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=200, return_mode="median") * 1e-3

    buffer = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * buffer.numel() / seconds(torch.Tensor.copy_, torch.empty_like(buffer), buffer)
    buffer = None
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print("each figure: weight bytes read / time, its share of the copy bandwidth, and the time")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scales = quantize_weight(weight)
        for rows in (1, 16):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            line = [f"{name:>8} {n}x{k} M={rows:>2}:"]
            t = seconds(F.linear, x, weight)
            line.append(f"bf16 {weight.numel() * 2 / t / 1e12:.2f} TB/s ({weight.numel() * 2 / t / copy_bw:.0%}) "
                        f"{t * 1e6:.1f} us")
            if scaled_mm_supported(x.device):
                t = seconds(fp8_linear, x, q, scales)
                line.append(f"scaled_mm {q.numel() / t / 1e12:.2f} TB/s ({q.numel() / t / copy_bw:.0%}) {t * 1e6:.1f} us")
            timed = []
            for config in CONFIGS:
                try:
                    timed.append((seconds(fp8_weight_gemm, x, q, scales, config=config), config))
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
                    print(f"    {config}: {type(exc).__name__}")
            t, config = min(timed, key=lambda pair: pair[0])
            line.append(f"triton best {q.numel() / t / 1e12:.2f} TB/s ({q.numel() / t / copy_bw:.0%}) {t * 1e6:.1f} us "
                        f"{config}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
