"""Backs the CPU KV cache with 2 MiB transparent huge pages.

Why: a KV pull between two processes on one host goes through process_vm_readv (UCX's cma transport), which
looks up, pins and copies the source pages one by one; with 2 MiB pages on both sides there are 512 times
fewer of them (benchmarks/kv_transfer.py prints the rate with and without). Many hosts run THP in `madvise`
mode, so memory gets huge pages only if it asks. MADV_COLLAPSE (Linux 6.1+) turns the already-filled memory
of a tensor into huge pages in place, synchronously, whatever the THP mode short of `never`; elsewhere this
does nothing. Only the KV cache asks for it: it is the memory other processes read.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def collapse_into_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Asks the kernel to back each CPU tensor's whole 2 MiB pages with huge pages; returns the bytes it
    accepted (0 where the call is missing or refused). Tensors are left as they are, content unchanged."""
    if _MADVISE is None:
        return 0
    done, seen = 0, set()
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0:
            continue  # opaque layouts (oneDNN's) expose no address
        begin = tensor.untyped_storage().data_ptr()
        if begin in seen:  # views of one storage
            continue
        seen.add(begin)
        start = -(-begin // HUGE_PAGE) * HUGE_PAGE
        end = (begin + tensor.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        if _MADVISE(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
        else:  # an old kernel, THP `never`, no free huge pages: this tensor stays on 4 KiB pages
            log.debug("MADV_COLLAPSE refused (errno %d) for %d bytes", ctypes.get_errno(), end - start)
    return done
