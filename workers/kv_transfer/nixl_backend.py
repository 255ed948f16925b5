"""KV pulls over NIXL: the decode side READs registered memory of the prefill side (UCX underneath:
RDMA, CUDA IPC, shared memory or TCP, whichever UCX finds between the two agents)."""

from __future__ import annotations

import base64
import threading
import time

import torch

from tandem.workers.kv_transfer.base import KVTransfer, KVTransferError, coalesce


class NixlTransfer(KVTransfer):
    backend = "nixl"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, api):
        super().__init__(kv_cache, agent_name)
        self._agent = api.nixl_agent(agent_name, api.nixl_agent_config(backends=["UCX"]))
        self._registration = self._agent.register_memory(kv_cache)
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._known_peers: dict[str, bytes] = {}
        self._lock = threading.Lock()  # NIXL agents are not documented as thread-safe

    def agent_info(self) -> dict:
        return {"backend": self.backend, "agent_name": self.agent_name,
                "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "base_address": self.kv_cache.data_ptr(), "block_bytes": self.block_bytes,
                "mem_type": self._mem_type, "device_id": self._device_id}

    def _ensure_peer(self, remote: dict) -> str:
        name, metadata = remote["agent_name"], base64.b64decode(remote["metadata"])
        if self._known_peers.get(name) != metadata:  # new peer, or the peer restarted with new metadata
            if name in self._known_peers:
                self._agent.remove_remote_agent(name)
            self._agent.add_remote_agent(metadata)
            self._known_peers[name] = metadata
        return name

    def read_blocks(self, remote: dict, remote_block_ids: list[int], local_block_ids: list[int],
                    timeout_s: float) -> int:
        if remote.get("block_bytes") != self.block_bytes:
            raise KVTransferError(f"block size mismatch: remote {remote.get('block_bytes')} B, local {self.block_bytes} B")
        runs = coalesce(remote_block_ids, local_block_ids)
        size = self.block_bytes
        local = [(self.block_address(loc), n * size, self._device_id) for _, loc, n in runs]
        far = [(remote["base_address"] + r * size, n * size, remote["device_id"]) for r, _, n in runs]
        with self._lock:
            try:
                peer = self._ensure_peer(remote)
                local_descs = self._agent.get_xfer_descs(local, self._mem_type)
                remote_descs = self._agent.get_xfer_descs(far, remote["mem_type"])
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            except Exception as exc:  # NIXL raises its own errors for unknown or dead peers
                raise KVTransferError(f"nixl: could not set up the read from {remote.get('agent_name')}: {exc}") from exc
            try:
                if self._agent.transfer(handle) == "ERR":
                    raise KVTransferError("nixl: transfer could not be posted")
                start = time.monotonic()
                while (state := self._agent.check_xfer_state(handle)) != "DONE":
                    if state == "ERR":
                        raise KVTransferError(f"nixl: transfer from {peer} failed")
                    waited = time.monotonic() - start
                    if waited > timeout_s:
                        raise KVTransferError(f"nixl: transfer from {peer} timed out after {timeout_s}s")
                    if waited > 0.002:  # spin briefly for latency, then stop burning a core
                        time.sleep(0.0002)
            finally:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # a timed-out transfer may refuse release; the agent reclaims it on close
                    pass
        return sum(n for _, _, n in runs) * size

    def close(self) -> None:
        with self._lock:
            self._agent.deregister_memory(self._registration)
