"""The CUDA-graph runner's contract that holds on any machine: batch sizes and what it refuses. (Its padding
is exercised through the whole engine in tests/workers/test_engine_triton.py, uncaptured in the Triton interpreter,
and captured on a GPU.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.workers.engine.cuda_graphs import DecodeGraphs, default_batch_sizes


def test_default_batch_sizes_cover_every_batch_up_to_the_cap():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_batch_sizes(1000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b % 8 == 0 for b in sizes[3:])


def _model(backend: str):
    return SimpleNamespace(ops=SimpleNamespace(backend=backend))


def test_refuses_the_torch_backend_and_capture_without_cuda():
    kv_cache = torch.zeros(4, 1, 2, 16, 1, 8)
    with pytest.raises(ValueError, match="Triton"):
        DecodeGraphs(_model("torch"), kv_cache, 16, 64, [1, 2], capture=False)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(_model("triton"), kv_cache, 16, 64, [1, 2], capture=True)
    with pytest.raises(ValueError, match="positive"):
        DecodeGraphs(_model("triton"), kv_cache, 16, 64, [], capture=False)


def test_static_buffers_are_sized_for_the_largest_graph_and_the_longest_context():
    graphs = DecodeGraphs(_model("triton"), torch.zeros(4, 1, 2, 16, 1, 8), 16, 100, [4, 1, 2], capture=False)
    assert graphs.batch_sizes == [1, 2, 4] and graphs.max_batch == 4
    assert tuple(graphs.inputs.block_tables.shape) == (4, 7)  # ceil(100 / 16) blocks per sequence
    assert graphs.inputs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert graphs.inputs.slot_mapping.tolist() == [-1] * 4  # padding rows write no KV
