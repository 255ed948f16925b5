"""Large CPU tensors move onto 2 MiB pages in place, content unchanged; small ones are left alone."""

import ctypes
import errno
import platform

import pytest
import torch

from tandem.workers.engine import huge_pages
from tandem.workers.engine.huge_pages import HUGE_PAGE, collapse_into_huge_pages


def _kernel_collapses() -> bool:
    """MADV_COLLAPSE exists from Linux 6.1 and works unless THP is `never`."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and "[never]" not in mode


def _refusal_for_want_of_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether MADV_COLLAPSE on the tensor fails now for want of free huge pages (EAGAIN, ENOMEM), as it can on a
    host whose memory is in use or fragmented, rather than for a reason that would be a bug here."""
    begin = tensor.untyped_storage().data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    if huge_pages._MADVISE(start, _interior(tensor), huge_pages.MADV_COLLAPSE) == 0:
        return False
    return ctypes.get_errno() in (errno.EAGAIN, errno.ENOMEM)


def _interior(tensor: torch.Tensor) -> int:
    begin = tensor.untyped_storage().data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    end = (begin + tensor.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    return max(0, end - start)


def _huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the memory mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def test_large_tensors_collapse_in_place_and_keep_their_values():
    big = torch.randn(3 << 20)  # 12 MiB: at least five whole huge pages inside it
    tied = big[: 1 << 20]  # a view of the same storage is counted once
    small = torch.randn(1000)
    before_big, before_small = big.clone(), small.clone()
    moved = collapse_into_huge_pages([big, tied, small])
    assert torch.equal(big, before_big) and torch.equal(small, before_small)
    if _kernel_collapses():
        if moved == 0 and _refusal_for_want_of_huge_pages(big):
            pytest.skip("the kernel had no free huge pages just now (a loaded host): nothing to check")
        assert moved == _interior(big) >= 5 * HUGE_PAGE
        # The kernel may split a huge page again at any time (reclaim; a DAMON daemon of a shared host did, once,
        # between the collapse and this read: 8 of 10 MiB): a shortfall is collapsed again before it counts.
        for _ in range(3):
            if _huge_bytes_of_mapping(big.data_ptr() + HUGE_PAGE * 2) >= _interior(big):
                break
            collapse_into_huge_pages([big])
        assert _huge_bytes_of_mapping(big.data_ptr() + HUGE_PAGE * 2) >= _interior(big)
    else:
        assert moved == 0


def test_nothing_to_do_for_small_or_empty_tensors():
    assert collapse_into_huge_pages([torch.randn(100), torch.empty(0)]) == 0


def test_the_runner_puts_its_kv_cache_on_huge_pages():
    if not _kernel_collapses():
        pytest.skip("this kernel cannot collapse memory into huge pages (Linux < 6.1 or THP never)")
    from tandem.config import EngineConfig
    from tandem.workers.engine.model_runner import ModelRunner
    from tandem.workers.models.loader import load_model

    loaded = load_model("smollm2", dtype="float32", device="cpu", backend="torch")
    runner = ModelRunner(loaded, EngineConfig(model="smollm2", device="cpu", num_kv_blocks=64))
    cache = runner.kv_cache
    assert _interior(cache) > 0
    assert _huge_bytes_of_mapping(cache.data_ptr() + cache.nbytes // 2) >= _interior(cache)
