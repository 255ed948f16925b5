"""The KV-transfer interface both backends implement, and the factory that picks one.

The KV cache is one tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], so a
block of one request is a single contiguous span of `block_bytes` bytes across all layers: a
transfer is one descriptor per block (runs of adjacent blocks coalesce into one).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch


class KVTransferError(RuntimeError):
    """A pull failed or timed out; the caller falls back to recomputing the prompt."""


class KVTransfer(ABC):
    backend = ""

    def __init__(self, kv_cache: torch.Tensor, agent_name: str):
        assert kv_cache.is_contiguous(), "the KV cache must be one contiguous tensor"
        self.kv_cache = kv_cache
        self.agent_name = agent_name
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()

    @abstractmethod
    def agent_info(self) -> dict:
        """JSON-safe description a peer needs to read our blocks (served at /internal/kv/agent)."""

    @abstractmethod
    def read_blocks(self, remote: dict, remote_block_ids: list[int], local_block_ids: list[int],
                    timeout_s: float, lease_id: str | None = None) -> int:
        """Copy remote blocks into our local blocks (pairwise, in order); returns bytes moved. `lease_id`: the
        prefill worker's lease on them, which a backend that asks the peer for the blocks (TCP) shows it.
        Raises KVTransferError on any failure or timeout, leaving the local blocks unspecified."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def block_address(self, block_id: int) -> int:
        return self.kv_cache.data_ptr() + block_id * self.block_bytes


def coalesce(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """Pairs of block lists -> (remote_start, local_start, count) runs where both sides are adjacent."""
    runs: list[tuple[int, int, int]] = []
    for r, loc in zip(remote_ids, local_ids):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == loc:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, loc, 1))
    return runs


def _nixl_api():
    """NIXL's Python API from whichever wheel is installed (`nixl` meta, or a CUDA-specific one)."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    return _nixl_api() is not None


def create_kv_transfer(backend: str, kv_cache: torch.Tensor, agent_name: str, host: str = "127.0.0.1",
                       lanes: int = 2, authorize=None) -> KVTransfer:
    """backend: 'nixl', 'tcp', or 'auto' (NIXL when it imports, else TCP). lanes: NIXL reading agents
    a pull is split over. authorize: (lease id, block ids) -> bool, what the TCP server answers (see
    tcp_backend); NIXL reads are one-sided and ask the peer nothing."""
    if backend == "auto":
        backend = "nixl" if nixl_available() else "tcp"
    if backend == "nixl":
        api = _nixl_api()
        if api is None:
            raise RuntimeError("--kv-transfer nixl: the nixl package is not installed (pip install 'tandem[nixl]')")
        from tandem.workers.kv_transfer.nixl_backend import NixlTransfer

        return NixlTransfer(kv_cache, agent_name, api, lanes=lanes)
    if backend == "tcp":
        from tandem.workers.kv_transfer.tcp_backend import TcpTransfer

        return TcpTransfer(kv_cache, agent_name, host, authorize=authorize)
    raise ValueError(f"unknown KV transfer backend {backend!r}; use nixl, tcp or auto")
