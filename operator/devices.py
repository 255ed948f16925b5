"""The devices of a worker: each pool's tensor-parallel size, whether the deployment runs on GPUs, and what a
worker pod needs for its ranks (a GPU count, a /dev/shm sized for them, NCCL's defaults).

A deployment runs on GPUs when a pool names `nvidia.com/gpu` in its resources (a count above 0). A pool that names
a count keeps it (validation refuses one below its tensor-parallel size); one that names none gets one GPU per rank.
"""

from __future__ import annotations

from kubernetes.utils.quantity import parse_quantity

from tandem.operator.crd import LLMDeploymentSpec, ResourceRequirements
from tandem.operator.names import POOLS

GPU_RESOURCE = "nvidia.com/gpu"
# Set in a worker's env when its ranks talk over NCCL (GPUs, TP > 1), unless the pool's env sets the name itself.
NCCL_ENV = {"NCCL_DEBUG": "WARN"}  # NCCL's warnings and errors in the pod's log; nothing per collective
# /dev/shm of a worker: 1 GiB for UCX's shared-memory transport and torch's IPC, and 1 GiB per rank for NCCL's
# shared-memory transport (used between GPUs without peer access) and the ranks' own buffers.
SHM_BASE_GIB = 1
SHM_PER_RANK_GIB = 1


def pool_tp(spec: LLMDeploymentSpec, pool: str) -> int:
    """The tensor-parallel size of `pool`'s workers: its own, else spec.engine's."""
    own = getattr(spec, pool).tensor_parallel_size
    return spec.engine.tensor_parallel_size if own is None else own


def pool_gpus(resources: ResourceRequirements | None) -> int | None:
    """A pool's GPUs per worker as its resources name them (limit, else request); None when they name none.
    ValueError for a quantity that is no whole number: Kubernetes counts extended resources in whole units
    ("2", "1.0", "2000m")."""
    for bucket in (resources.limits, resources.requests) if resources is not None else ():
        if bucket and GPU_RESOURCE in bucket:
            quantity = str(bucket[GPU_RESOURCE])  # its form was checked by ResourceRequirements (QUANTITY_PATTERN)
            value = parse_quantity(quantity)
            if value < 0 or value != value.to_integral_value():
                raise ValueError(f"{GPU_RESOURCE} {quantity!r} is not a whole number of GPUs")
            return int(value)
    return None


def on_gpus(spec: LLMDeploymentSpec) -> bool:
    """Whether the workers run on GPUs: a pool names a GPU count above 0."""
    return any((pool_gpus(getattr(spec, pool).resources) or 0) > 0 for pool in POOLS)


def worker_gpus(spec: LLMDeploymentSpec, pool: str) -> int:
    """GPUs one worker of `pool` holds: the count its resources name, else one per rank on GPUs, else 0."""
    named = pool_gpus(getattr(spec, pool).resources)
    if named is not None:
        return named
    return pool_tp(spec, pool) if on_gpus(spec) else 0


def with_gpus(resources: dict, spec: LLMDeploymentSpec, pool: str) -> dict:
    """A worker container's `resources` (the pool's as written) with the GPU count added where they name none."""
    gpus = worker_gpus(spec, pool)
    if not gpus or pool_gpus(getattr(spec, pool).resources) is not None:
        return resources
    # In limits and requests alike, equal, as Kubernetes wants for an extended resource.
    return {**resources, **{bucket: {**resources.get(bucket, {}), GPU_RESOURCE: gpus}
                            for bucket in ("limits", "requests")}}


def shm_size(tp: int) -> str:
    """The sizeLimit of a worker's memory-backed /dev/shm (it counts against the pod's memory only as used)."""
    return f"{SHM_BASE_GIB + SHM_PER_RANK_GIB * tp}Gi"


def nccl_env(spec: LLMDeploymentSpec, pool: str) -> list[dict]:
    """NCCL's defaults for a pool whose ranks use it (GPUs, TP > 1), less the names the pool's env sets."""
    if pool_tp(spec, pool) < 2 or worker_gpus(spec, pool) < 1:
        return []
    own = {entry.name for entry in getattr(spec, pool).env or []}
    return [{"name": name, "value": value} for name, value in NCCL_ENV.items() if name not in own]
