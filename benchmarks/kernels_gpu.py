"""Triton attention kernel on a CUDA GPU, measured against what the memory system can do.

(a) Device-to-device copy bandwidth (torch copy of a large buffer, bytes read + bytes written per
    second): the practical ceiling for a memory-bound kernel.
(b) Decode: the paged attention kernel alone, batch 64 x 4,096-token contexts, on a Llama-3-8B layer
    (32 query heads, 8 KV heads, head dim 128, bf16, block size 16, shuffled block tables, the cache
    in the engine's [num_blocks, num_layers, 2, block_size, Hkv, D] layout read through a layer view).
    Achieved bytes/s (K and V read once, plus query and output) as a fraction of (a).
(c) Batch-1 decode at a long context, split-KV (flash decoding) as the heuristic picks it vs forced off; then
    (c) as a CUDA graph's replay too (no host launch gaps), and (c) and (b) again with the kernel specialized on
    the batch size and the block table's stride.
(d) Prefill: one 4,096-token causal prefill, TFLOP/s (causal FLOPs only), with torch SDPA on the same
    shape (contiguous tensors, no paging) as a reference point.
Prints its conditions; never asserts. Exits with a message when there is no CUDA device.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kernels_gpu.py [--layers 4] [--long-context 32768]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from tandem.workers.layers.metadata import AttentionMetadata

HQ, HKV, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


def paged_setup(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_layers: int, device
) -> tuple:
    """Query, per-layer K/V cache views and metadata for one batch, blocks handed out in shuffled order."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    kv_cache = torch.randn(num_blocks, num_layers, 2, block_size, HKV, HEAD_DIM, device=device, dtype=DTYPE)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[start : start + n]
        start += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(starts[-1], HQ, HEAD_DIM, device=device, dtype=DTYPE)
    layer = num_layers // 2
    return query, kv_cache[:, layer, 0], kv_cache[:, layer, 1], meta


def attention_bytes(query_lens: list[int], seq_lens: list[int]) -> int:
    """Bytes a perfect kernel moves: every cached K and V once, the query read and the output written."""
    elem = torch.finfo(DTYPE).bits // 8
    kv = sum(seq_lens) * HKV * HEAD_DIM * 2 * elem
    return kv + 2 * sum(query_lens) * HQ * HEAD_DIM * elem


def copy_bandwidth(device, do_bench) -> tuple[int, float]:
    """(bytes copied, median ms) for dst.copy_(src) of a 2 GiB buffer, far beyond L2."""
    src = torch.empty(2**30, dtype=DTYPE, device=device).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=500, return_mode="median")
    return src.numel() * src.element_size(), ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--layers", type=int, default=4, help="layers in the KV cache tensor (sets its strides)"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--long-context", type=int, default=32768)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/kernels_gpu.py needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False)."
        )

    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from tandem.workers.kernels import paged_attention as pa

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    print(f"torch {torch.__version__}, triton {triton.__version__}, dtype {DTYPE}")
    print(
        f"layer shape: {HQ} query heads, {HKV} KV heads, head dim {HEAD_DIM}; block size {args.block_size}; "
        f"KV cache [num_blocks, {args.layers} layers, 2, {args.block_size}, {HKV}, {HEAD_DIM}], layer view"
    )

    # (a) copy bandwidth
    copy_bytes, copy_ms = copy_bandwidth(device, do_bench)
    copy_bw = 2 * copy_bytes / (copy_ms * 1e-3)
    print(f"\n(a) device-to-device copy, {copy_bytes / 2**30:.0f} GiB: {copy_ms:.3f} ms, "
          f"{copy_bw / 1e12:.2f} TB/s (read + write)")  # fmt: skip

    scale = HEAD_DIM**-0.5

    def decode(batch: int, context: int, label: str, forced_splits: list[int | None], graph: bool = False) -> None:
        """graph: timed as a CUDA graph's replay, which leaves out the host's launch time between the kernel
        and the split merge (eager timings include any gap the host leaves the device)."""
        query_lens, seq_lens = [1] * batch, [context] * batch
        query, k_cache, v_cache, meta = paged_setup(
            query_lens, seq_lens, args.block_size, args.layers, device
        )
        moved = attention_bytes(query_lens, seq_lens)
        for splits in forced_splits:
            chosen = splits or pa.choose_num_splits(batch, HKV, context, device)
            run = lambda s=splits: pa.paged_attention(query, k_cache, v_cache, meta, scale, num_splits=s)  # noqa: E731
            if graph:
                try:
                    ms = do_bench_cudagraph(run, rep=200, return_mode="median")
                except RuntimeError as exc:  # a capture CUDA refuses: say so, measure the rest
                    print(f"{label} (CUDA graph): capture failed: {exc}")
                    continue
            else:
                ms = do_bench(run, warmup=25, rep=200, return_mode="median")
            bw = moved / (ms * 1e-3)
            how = ("heuristic" if splits is None else "forced") + (", CUDA graph" if graph else "")
            print(f"{label} num_splits={chosen} ({how}): {ms * 1e3:.1f} us, {moved / 1e9:.3f} GB -> "
                  f"{bw / 1e12:.2f} TB/s = {bw / copy_bw:.0%} of copy bandwidth")  # fmt: skip

    # (b) decode, batch 64 x 4,096
    print()
    decode(args.batch, args.context, f"(b) decode {args.batch} x {args.context}", [None])
    # (c) batch-1 decode at a long context: split-KV on (heuristic) vs off
    decode(1, args.long_context, f"(c) decode 1 x {args.long_context}", [None, 1])
    decode(1, args.long_context, f"(c) decode 1 x {args.long_context}", [None], graph=True)
    # ... and the same with the kernel specialized on num_seqs and the block table's stride, as it was before
    # 619965a stopped that (to compile fewer builds): on an H200 the 32-split case took 65.6 us before, 115.0 after.
    served = pa._paged_attention_kernel
    pa._paged_attention_kernel = triton.jit(served.fn)
    try:
        decode(1, args.long_context, f"(c) specialized, decode 1 x {args.long_context}", [None])
        decode(args.batch, args.context, f"(b) specialized, decode {args.batch} x {args.context}", [None])
    finally:
        pa._paged_attention_kernel = served

    # (d) prefill
    n = args.prefill
    query, k_cache, v_cache, meta = paged_setup([n], [n], args.block_size, args.layers, device)
    ms = do_bench(lambda: pa.paged_attention(query, k_cache, v_cache, meta, scale), warmup=10, rep=100)
    causal_flops = 4 * HQ * HEAD_DIM * (n * (n + 1) // 2)  # QK^T and PV, 2 FLOPs per multiply-add
    print(f"\n(d) prefill {n} tokens (causal): {ms:.3f} ms, {causal_flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")

    q = query.view(1, n, HQ, HEAD_DIM).transpose(1, 2).contiguous()
    k = torch.randn(1, HKV, n, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    try:
        sdpa_ms = do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            warmup=10, rep=100,
        )  # fmt: skip
        print(f"    torch SDPA, same shape, contiguous: {sdpa_ms:.3f} ms, "
              f"{causal_flops / (sdpa_ms * 1e-3) / 1e12:.1f} TFLOP/s")  # fmt: skip
    except (RuntimeError, TypeError) as err:  # enable_gqa needs torch >= 2.5
        print(f"    torch SDPA reference unavailable: {err}")


if __name__ == "__main__":
    main()
