"""Decode steps replayed from CUDA graphs, one graph per batch size.

A step of B sequences runs the smallest graph of at least B rows, padded; mixed steps and larger batches run
eagerly. Why and how the padding works: docs/design/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.workers.layers.metadata import AttentionMetadata


def default_batch_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included) or `largest`."""
    top = min(max_num_seqs, largest)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    return sorted({*sizes, top})


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # int64 [max_batch]
    positions: torch.Tensor  # int64 [max_batch]
    slot_mapping: torch.Tensor  # int64 [max_batch]
    seq_lens: torch.Tensor  # int32 [max_batch]
    query_start_loc: torch.Tensor  # int32 [max_batch + 1]: 0, 1, 2, ... (one token per sequence), never written
    block_tables: torch.Tensor  # int32 [max_batch, max_blocks_per_seq]


class DecodeGraphs:
    """Runs decode-only steps of `model` through per-batch-size graphs.

    capture=False keeps everything but the capture: the same static buffers and padding, run eagerly. That
    is how the padding is tested where there is no CUDA device (the Triton kernels in the interpreter).
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int,
                 batch_sizes: list[int], capture: bool = True):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        if getattr(model.ops, "backend", None) != "triton":
            raise ValueError("decode graphs need the Triton ops backend (the torch path syncs with the host)")
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {kv_cache.device}")
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        device = kv_cache.device
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.inputs = _StaticInputs(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(n, max_blocks, dtype=torch.int32, device=device),
        )
        self._metas = {b: self._meta(b) for b in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from a graph (or from the static buffers, uncaptured)
        if capture:
            self._capture_all()

    def _meta(self, batch: int) -> AttentionMetadata:
        s = self.inputs
        # Host-side lengths only size the launch: max_seq_len = max_model_len picks the KV split count for
        # the longest context a graph may ever see.
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:batch], query_start_loc=s.query_start_loc[: batch + 1],
            seq_lens=s.seq_lens[:batch], block_tables=s.block_tables[:batch],
            query_lens_list=[1] * batch, seq_lens_list=[self.max_model_len] * batch,
            max_query_len=1, max_seq_len=self.max_model_len,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        s = self.inputs
        return self.model.forward(s.input_ids[:batch], s.positions[:batch], self.kv_cache, self._metas[batch])

    def _capture_all(self) -> None:
        # Largest first, all in one memory pool: smaller graphs reuse the larger ones' intermediate buffers.
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batch_sizes):
            self._forward(batch)  # compiles the Triton kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[batch] = self._forward(batch)
            self._graphs[batch] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step of B <= max_batch sequences. The result is a view
        of the graph's output buffer: use it before the next step."""
        n = meta.num_seqs
        batch = next(b for b in self.batch_sizes if b >= n)
        s = self.inputs
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.slot_mapping[n:batch].fill_(-1)
        s.seq_lens[:n].copy_(meta.seq_lens)
        s.seq_lens[n:batch].fill_(0)
        # Columns past a sequence's own blocks keep stale ids: the kernels read no block past seq_len.
        s.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.replays += 1
        graph = self._graphs.get(batch)
        if graph is None:
            return self._forward(batch)[:n]
        graph.replay()
        return self._outputs[batch][:n]
