"""What one forward pass needs to know about the flattened batch and the paged KV cache.

KV cache layout (one tensor per engine):
    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
so that one block of one request is contiguous across all layers: a KV transfer moves one
descriptor per block. Layer `l` reads keys as kv_cache[:, l, 0] and values as kv_cache[:, l, 1],
each a (non-contiguous) view of shape [num_blocks, block_size, num_kv_heads, head_dim].

The batch is flattened: sequence b contributes tokens query_start_loc[b]:query_start_loc[b+1];
a decode contributes 1 token, a prefill chunk several. Token i of sequence b sits at position
seq_lens[b] - query_len_b + i and attends causally to every cached key at or before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset where each new token's K/V goes
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    # Host copies so the CPU path never syncs or converts.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
