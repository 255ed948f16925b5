"""A tensor-parallel decode step's communication on a GPU fleet: its all-reduces, the bytes each rank moves and
their time over the GPUs' link, beside the step's weight read from HBM (docs/tensor-parallel.md, "What TP costs").

Per decode step, a model of L layers split over N ranks runs 2 L + 1 all-reduces (o_proj and down_proj per layer,
and the vocabulary-parallel embedding) of batch x hidden activations. A ring all-reduce moves 2 (N - 1) / N of
the tensor per rank, and costs a fixed latency besides. Each rank reads 1/N of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's nominal figures: HBM bandwidth, the link's bandwidth per direction, and an all-reduce's fixed cost."""

    name: str
    hbm_bytes_s: float
    link_bytes_s: float
    all_reduce_latency_s: float


@dataclass(frozen=True)
class ModelShape:
    """What a decode step's communication and weight read depend on."""

    name: str
    layers: int
    hidden: int
    params: float
    weight_bytes: float = 2.0  # per parameter: bf16
    activation_bytes: float = 2.0


# Nominal datasheet figures: HBM bandwidth, and NVLink 4's bandwidth each way per GPU. The latency is an assumption
# (a small NCCL all-reduce within one NVLink node, CUDA graphs on), not a measurement.
GPUS = {
    "h100": GPUSpec("H100", 3.35e12, 450e9, 8e-6),
    "h200": GPUSpec("H200", 4.8e12, 450e9, 8e-6),
}
MODELS = {
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 4096, 8.03e9),
    "llama-3-70b": ModelShape("Llama-3-70B", 80, 8192, 70.6e9),
}


@dataclass(frozen=True)
class StepComm:
    all_reduces: int
    bytes_per_rank: float  # moved over the link by each rank, per step
    comm_s: float
    weights_s: float  # each rank's weight read at the HBM bandwidth


def decode_step_comm(model: ModelShape, gpu: GPUSpec, tp: int, batch: int) -> StepComm:
    """The communication of one decode step of `batch` sequences at TP `tp`, and its weight read."""
    if tp < 1 or batch < 1:
        raise ValueError(f"tp and batch must be at least 1, got {tp} and {batch}")
    weights_s = model.params * model.weight_bytes / tp / gpu.hbm_bytes_s
    if tp == 1:
        return StepComm(0, 0.0, 0.0, weights_s)
    count = 2 * model.layers + 1
    tensor = batch * model.hidden * model.activation_bytes
    moved = 2 * (tp - 1) / tp * tensor
    comm_s = count * (gpu.all_reduce_latency_s + moved / gpu.link_bytes_s)
    return StepComm(count, count * moved, comm_s, weights_s)
