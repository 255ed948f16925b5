"""Tensor parallelism: one worker's model split over N processes (ranks), one device each.

Rank 0 is the worker: its HTTP server, scheduler and sampler. Ranks 1..N-1 are followers it starts: each loads its
shard of every weight and holds its KV heads, and runs each step's forward pass in lockstep with rank 0, which
broadcasts the step's inputs (StepInputs). The model's collectives (an all-reduce after each row-parallel GEMM, the
vocabulary-parallel embedding and LM head) run over torch.distributed: NCCL on CUDA, gloo on the CPU. docs/
tensor-parallel.md has the layout.

A follower that dies takes its worker with it: rank 0 exits as soon as it sees one gone (watch, exit_on_loss), so that
the worker fails its health checks and is restarted whole, never left half alive.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a collective may wait for a peer before it fails (gloo's default is 30 minutes: a rank that hangs would
# hang the worker as long).
COLLECTIVE_TIMEOUT_S = 120.0


class TPGroup:
    """This process's place in its worker's tensor-parallel group, and the collectives the model runs."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors (equal shapes) side by side along the last dimension, on every rank."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: object) -> object:
        """`obj` from rank 0 to every rank (its value on the others is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of `total` items in `parts` even parts (the last ones one shorter when they do
    not divide)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def check_sizes(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError in one line naming the numbers when a model cannot be split `size` ways: its query heads must
    divide evenly, its KV heads divide or be divided (replicated when fewer than the ranks, as vLLM does), and its
    MLP width divide."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if num_heads % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {num_kv_heads} KV heads: one must divide the "
                         "other")
    if intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's MLP width {intermediate_size}")


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @classmethod
    def of(cls, rank: int, size: int, num_heads: int, num_kv_heads: int) -> HeadShard:
        q_start, q_end = split(num_heads, size, rank)
        if size <= num_kv_heads:
            kv_start, kv_end = split(num_kv_heads, size, rank)
        else:  # fewer KV heads than ranks: each rank holds the one its query heads read
            kv_start = q_start // (num_heads // num_kv_heads)
            kv_end = kv_start + 1
        return cls(q_start, q_end, kv_start, kv_end)


def device_for(rank: int, device: torch.device) -> torch.device:
    """The device rank `rank` computes on: its own GPU, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_process_group(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
    """Joins the group as `rank` (rank 0 listens on `port`). On the CPU the ranks share the cores: each computes
    with its share of them."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // size)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, size)


def start_followers(size: int, port: int, engine_config_json: str) -> list[subprocess.Popen]:
    """Ranks 1..size-1 as child processes of this one (they die with it)."""
    from tandem.runtimes.launcher import _die_with_parent

    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return [subprocess.Popen([sys.executable, "-m", "tandem.workers.tp_follower", "--rank", str(rank), "--size",
                              str(size), "--port", str(port), "--engine-config", engine_config_json],
                             env=env, preexec_fn=_die_with_parent)
            for rank in range(1, size)]


def watch(followers: list[subprocess.Popen], on_loss, interval_s: float = 0.5) -> threading.Thread:
    """A thread that calls on_loss(rank, exit code) once a follower exits."""

    def run():
        while True:
            for rank, proc in enumerate(followers, start=1):
                code = proc.poll()
                if code is not None:
                    on_loss(rank, code)
                    return
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="tp-watch", daemon=True)
    thread.start()
    return thread


def exit_on_loss(rank: int, code: int) -> None:
    """A follower is gone: the worker cannot compute another step; it exits so that it is restarted whole."""
    log.error("tensor-parallel rank %d exited (code %s): the worker exits to be restarted whole", rank, code)
    logging.shutdown()
    os._exit(3)
