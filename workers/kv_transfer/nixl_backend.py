"""KV pulls over NIXL: the decode side READs registered memory of the prefill side (UCX underneath:
RDMA, CUDA IPC, shared memory or TCP, whichever UCX finds between the two agents)."""

from __future__ import annotations

import base64
import threading
import time

import torch

from tandem.workers.kv_transfer.base import KVTransfer, KVTransferError, coalesce

# nixl_agent hard-codes the progress thread's delay to 0, which the UCX plugin passes to poll() as a
# 0 ms timeout: the thread busy-spins a whole core for the life of the agent, idle or not (measured
# 100% of a core idle; on a 2-core host the two spinning agents of a P/D pair starved the copy itself:
# 2.0 GB/s = 18% of memcpy for 512 MiB; with 1 ms: 4.5-5.1 GB/s = 44-53%, the process_vm_readv rate
# of UCX's cma lane). The thread still wakes at once on the UCX worker's event fd; the delay only
# bounds its fallback periodic wake-up, so 1 ms costs ~2-3% of a core idle.
PROGRESS_THREAD_DELAY_US = 1000
_agent_creation = threading.Lock()


class _BindingsWithProgressDelay:
    """The NIXL bindings module, except that agents are created with our progress-thread delay."""

    def __init__(self, bindings, delay_us: int):
        self._bindings, self._delay_us = bindings, delay_us

    def __getattr__(self, name):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, config):  # noqa: N802 - the bindings' name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def create_agent(api, agent_name: str, delay_us: int = PROGRESS_THREAD_DELAY_US):
    """api.nixl_agent with the UCX backend and a progress thread that sleeps when idle. The Python API
    has no knob for the delay, so its bindings module is swapped for the constructor call only; a
    NIXL version without that module attribute gets its default (spinning) thread."""
    config = api.nixl_agent_config(backends=["UCX"])
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgentConfig"):
        return api.nixl_agent(agent_name, config)
    with _agent_creation:
        api.nixlBind = _BindingsWithProgressDelay(bindings, delay_us)
        try:
            return api.nixl_agent(agent_name, config)
        finally:
            api.nixlBind = bindings


class NixlTransfer(KVTransfer):
    backend = "nixl"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, api):
        super().__init__(kv_cache, agent_name)
        self._agent = create_agent(api, agent_name)
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
