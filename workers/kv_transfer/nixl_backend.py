"""KV pulls over NIXL: the decode side READs registered memory of the prefill side (UCX underneath:
RDMA, CUDA IPC, shared memory or TCP, whichever UCX finds between the two agents)."""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

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


def create_agent(api, agent_name: str, delay_us: int = PROGRESS_THREAD_DELAY_US, progress_thread: bool = True):
    """api.nixl_agent with the UCX backend and, if asked, a progress thread that sleeps when idle. The
    Python API has no knob for the delay, so its bindings module is swapped for the constructor call
    only; a NIXL version without that module attribute gets its default (spinning) thread."""
    config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread)
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgentConfig"):
        return api.nixl_agent(agent_name, config)
    with _agent_creation:
        api.nixlBind = _BindingsWithProgressDelay(bindings, delay_us)
        try:
            return api.nixl_agent(agent_name, config)
        finally:
            api.nixlBind = bindings


def split_even(segments: list[tuple[int, int, int]], parts: int, unit: int) -> list[list[tuple[int, int, int]]]:
    """(local address, remote address, bytes) segments -> `parts` lists of nearly equal bytes, cut at
    multiples of `unit` (a block); fewer lists when there are fewer units than parts."""
    total_units = sum(n for _, _, n in segments) // unit
    shares = [total_units // parts + (i < total_units % parts) for i in range(parts)]
    out: list[list[tuple[int, int, int]]] = []
    queue = deque(segments)
    for share in shares:
        if share == 0:
            break
        need, part = share * unit, []
        while need:
            local, far, n = queue.popleft()
            take = min(n, need)
            part.append((local, far, take))
            if take < n:
                queue.appendleft((local + take, far + take, n - take))
            need -= take
        out.append(part)
    return out


class _Agent:
    """One NIXL agent with the whole cache registered, and the peers it has loaded."""

    def __init__(self, api, agent_name: str, kv_cache: torch.Tensor, progress_thread: bool):
        self.agent = create_agent(api, agent_name, progress_thread=progress_thread)
        self.registration = self.agent.register_memory(kv_cache)
        self.known_peers: dict[str, bytes] = {}

    def ensure_peer(self, remote: dict) -> str:
        name, metadata = remote["agent_name"], base64.b64decode(remote["metadata"])
        if self.known_peers.get(name) != metadata:  # new peer, or the peer restarted with new metadata
            if name in self.known_peers:
                self.agent.remove_remote_agent(name)
            self.agent.add_remote_agent(metadata)
            self.known_peers[name] = metadata
        return name

    def read(self, remote: dict, segments: list[tuple[int, int, int]], mem_type: str, device_id: int,
             timeout_s: float) -> None:
        agent = self.agent
        try:
            peer = self.ensure_peer(remote)
            local_descs = agent.get_xfer_descs([(loc, n, device_id) for loc, _, n in segments], mem_type)
            remote_descs = agent.get_xfer_descs([(far, n, remote["device_id"]) for _, far, n in segments],
                                                remote["mem_type"])
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        except Exception as exc:  # NIXL raises its own errors for unknown or dead peers
            raise KVTransferError(f"nixl: could not set up the read from {remote.get('agent_name')}: {exc}") from exc
        try:
            if agent.transfer(handle) == "ERR":
                raise KVTransferError("nixl: transfer could not be posted")
            start = time.monotonic()
            while (state := agent.check_xfer_state(handle)) != "DONE":
                if state == "ERR":
                    raise KVTransferError(f"nixl: transfer from {peer} failed")
                waited = time.monotonic() - start
                if waited > timeout_s:
                    raise KVTransferError(f"nixl: transfer from {peer} timed out after {timeout_s}s")
                if waited > 0.002:  # spin briefly for latency, then stop burning a core
                    time.sleep(0.0002)
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # a timed-out transfer may refuse release; the agent reclaims it on close
                pass

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)


class NixlTransfer(KVTransfer):
    """The agent peers read from, with a progress thread (it answers UCX's connection set-up), and
    `lanes` reading agents without one, a pull split evenly over them, each in its own thread.
    Why: on one host UCX copies with process_vm_readv inside the posting call, and one thread of it
    reaches about half of memcpy; lanes copy in parallel. Reading through an agent that has a progress
    thread made that thread spin for the whole copy (a second core burnt for nothing); an agent that
    only reads progresses its worker itself while it waits."""

    backend = "nixl"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, api, lanes: int = 2):
        super().__init__(kv_cache, agent_name)
        if lanes < 1:
            raise ValueError(f"kv transfer lanes must be >= 1, got {lanes}")
        self._served = _Agent(api, agent_name, kv_cache, progress_thread=True)
        self._lanes = [_Agent(api, f"{agent_name}.reader{i}", kv_cache, progress_thread=False) for i in range(lanes)]
        self._pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="kv-lane") if lanes > 1 else None
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._lock = threading.Lock()  # one pull at a time: an agent is used by one thread at a time

    def agent_info(self) -> dict:
        return {"backend": self.backend, "agent_name": self.agent_name,
                "metadata": base64.b64encode(self._served.agent.get_agent_metadata()).decode(),
                "base_address": self.kv_cache.data_ptr(), "block_bytes": self.block_bytes,
                "mem_type": self._mem_type, "device_id": self._device_id}

    def read_blocks(self, remote: dict, remote_block_ids: list[int], local_block_ids: list[int],
                    timeout_s: float, lease_id: str | None = None) -> int:
        if remote.get("block_bytes") != self.block_bytes:
            raise KVTransferError(f"block size mismatch: remote {remote.get('block_bytes')} B, local {self.block_bytes} B")
        size = self.block_bytes
        segments = [(self.block_address(loc), remote["base_address"] + r * size, n * size)
                    for r, loc, n in coalesce(remote_block_ids, local_block_ids)]
        shares = split_even(segments, len(self._lanes), size)
        with self._lock:
            others = [self._pool.submit(lane.read, remote, share, self._mem_type, self._device_id, timeout_s)
                      for lane, share in zip(self._lanes[1:], shares[1:])]
            errors = []
            try:
                if shares:
                    self._lanes[0].read(remote, shares[0], self._mem_type, self._device_id, timeout_s)
            except KVTransferError as exc:
                errors.append(exc)
            for future in others:  # wait for every lane, even after an error: none may still write
                try:
                    future.result()
                except KVTransferError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        return sum(n for _, _, n in segments)

    def close(self) -> None:
        with self._lock:
            for agent in (self._served, *self._lanes):
                agent.close()
            if self._pool is not None:
                self._pool.shutdown()
