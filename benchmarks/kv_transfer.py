"""KV-transfer bandwidth between two processes on one host, NIXL and TCP, against memcpy.

Moves the KV cache of a 4,096-token prompt in Llama-3-8B's cache shape (32 layers, 8 KV heads,
head dim 128, bf16: 128 KiB per token, 512 MiB in all, 256 blocks of 16 tokens) from a "prefill"
process to this "decode" process, as the workers do: one READ per run of adjacent blocks
(--scatter makes every block its own descriptor). The peer figure is single-threaded memcpy
(ctypes.memmove) of the same bytes in this process, measured in the same run. Target (issue 4):
NIXL >= 50% of memcpy on CPU loopback. NIXL splits a pull over --lanes reading agents, each copying
in its own thread (the workers' --kv-transfer-lanes, default 2). On Linux it also prints one thread
of process_vm_readv of the same bytes from another process, the kernel call under UCX's "cma" lane
(which UCX picks for these READs; the kernel pins and copies 4 KiB pages): what one lane can reach.
Both caches are put on 2 MiB pages as the workers' are (MADV_COLLAPSE where the kernel has it; --small-pages
to leave them on 4 KiB pages). Every block moved is checked against the source. Prints conditions and ratios;
never asserts.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kv_transfer.py [--tokens 4096] [--repeats 5] [--scatter] [--lanes 2]
        [--small-pages]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import platform
import random
import time

import torch

from tandem.workers.engine.huge_pages import collapse_into_huge_pages

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def cache_shape(num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)


def block_sums(cache: torch.Tensor) -> torch.Tensor:
    """One float64 sum per block: enough to tell whether every block arrived where it should."""
    return torch.stack([block.double().sum() for block in cache])


def kv_cache(num_blocks: int, fill: str, huge_pages: bool) -> torch.Tensor:
    """A cache as a worker holds it: on 2 MiB pages unless asked not to."""
    if fill == "random":
        cache = torch.randn(cache_shape(num_blocks), dtype=torch.float32).to(torch.bfloat16)
    else:
        cache = torch.full(cache_shape(num_blocks), 1.0 if fill == "ones" else 0.0, dtype=torch.bfloat16)
    if huge_pages:
        collapse_into_huge_pages([cache])
    return cache


def prefill_process(backend: str, num_blocks: int, huge_pages: bool, conn) -> None:
    from tandem.workers.kv_transfer import create_kv_transfer

    cache = kv_cache(num_blocks, "random", huge_pages)
    transfer = create_kv_transfer(backend, cache, f"bench-prefill-{backend}")
    conn.send((transfer.agent_info(), block_sums(cache)))
    conn.recv()  # wait until the decode side is done
    transfer.close()


def hold_cache_process(num_blocks: int, huge_pages: bool, conn) -> None:
    import os

    cache = kv_cache(num_blocks, "ones", huge_pages)
    conn.send((os.getpid(), cache.data_ptr()))
    conn.recv()


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def measure_process_vm_readv(num_blocks: int, repeats: int, huge_pages: bool) -> float | None:
    """Best single-threaded process_vm_readv rate from a spawned process, in 512 KiB calls as UCX
    issues them; None where the call is missing or refused (not Linux, ptrace restrictions)."""
    try:
        readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):
        return None
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=hold_cache_process, args=(num_blocks, huge_pages, child))
    proc.start()
    try:
        pid, remote = parent.recv()
        dest = kv_cache(num_blocks, "zeros", huge_pages)
        nbytes, seg = dest.numel() * dest.element_size(), 512 << 10
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for off in range(0, nbytes, seg):
                n = min(seg, nbytes - off)
                local, far = _IoVec(dest.data_ptr() + off, n), _IoVec(remote + off, n)
                if readv(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0) != n:
                    return None
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        parent.send("done")
        proc.join(30)


def measure_memcpy(nbytes: int, repeats: int, huge_pages: bool) -> float:
    """Single-threaded memmove between two buffers on the same page size as the caches."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.zeros_like(src)
    if huge_pages:
        collapse_into_huge_pages([src, dst])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_backend(backend: str, num_blocks: int, repeats: int, scatter: bool, lanes: int,
                    huge_pages: bool) -> tuple[float, bool]:
    from tandem.workers.kv_transfer import create_kv_transfer

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(backend, num_blocks, huge_pages, child))
    proc.start()
    try:
        info, source_sums = parent.recv()
        dest = kv_cache(num_blocks, "zeros", huge_pages)
        transfer = create_kv_transfer(backend, dest, f"bench-decode-{backend}", lanes=lanes)
        remote = list(range(num_blocks))
        local = list(range(num_blocks))
        if scatter:  # no two adjacent: every block is its own descriptor
            random.Random(0).shuffle(local)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            moved = transfer.read_blocks(info, remote, local, timeout_s=60)
            best = min(best, time.perf_counter() - t)
        ok = torch.equal(block_sums(dest)[local], source_sums[remote])  # remote block r landed at local[r]
        transfer.close()
        return moved / best, ok
    finally:
        parent.send("done")
        proc.join(30)


def huge_page_status(nbytes: int, small_pages: bool) -> str:
    if small_pages:
        return "4 KiB pages (--small-pages)"
    probe = torch.zeros(8 << 20, dtype=torch.uint8)
    return "2 MiB pages" if collapse_into_huge_pages([probe]) else "4 KiB pages (this kernel refused MADV_COLLAPSE)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scatter", action="store_true", help="one descriptor per block instead of coalesced runs")
    ap.add_argument("--backends", nargs="+", default=["nixl", "tcp"])
    ap.add_argument("--lanes", type=int, default=2, help="NIXL reading agents a pull is split over")
    ap.add_argument("--small-pages", action="store_true", help="leave both caches on 4 KiB pages")
    args = ap.parse_args()
    from tandem.workers.kv_transfer import nixl_available

    num_blocks = args.tokens // BLOCK
    nbytes = num_blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    print("== conditions ==")
    print(f"{args.tokens} tokens in Llama-3-8B cache shape (layers {LAYERS}, kv heads {KV_HEADS}, head dim {HEAD_DIM}, "
          f"bf16, block {BLOCK}) = {nbytes / 2**20:.0f} MiB; two processes on one host ({platform.machine()}, "
          f"{mp.cpu_count()} cores), host memory; best of {args.repeats}; "
          f"{'scattered blocks' if args.scatter else 'contiguous block runs'}; NIXL lanes {args.lanes}; caches on "
          f"{huge_page_status(nbytes, args.small_pages)}")
    huge = not args.small_pages
    memcpy_bw = measure_memcpy(nbytes, args.repeats, huge)
    print(f"memcpy (single thread)  {memcpy_bw / 1e9:6.2f} GB/s")
    readv_bw = measure_process_vm_readv(num_blocks, args.repeats, huge)
    if readv_bw is not None:
        print(f"process_vm_readv        {readv_bw / 1e9:6.2f} GB/s  = {readv_bw / memcpy_bw:5.1%} of memcpy  "
              f"(one thread: what one lane of UCX's cma transport can reach)")
    for backend in args.backends:
        if backend == "nixl" and not nixl_available():
            print("nixl                    not installed (pip install nixl-cu12)")
            continue
        bw, ok = measure_backend(backend, num_blocks, args.repeats, args.scatter, args.lanes, huge)
        print(f"{backend:<23} {bw / 1e9:6.2f} GB/s  = {bw / memcpy_bw:5.1%} of memcpy  "
              f"(data {'verified' if ok else 'MISMATCH'}; target NIXL >= 50%)")


if __name__ == "__main__":
    main()
