"""Tensor parallelism per pool: the CRD, the worker pods (args, GPUs, /dev/shm, NCCL env), validation, status and
the planner's GPU budget; the real kopf operator against kmock's emulated API server where it matters."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml
from kube_emulator import CR, EXAMPLE

from tandem.operator import devices
from tandem.operator.builders import Owner, build_objects
from tandem.operator.crdgen import crd_manifest
from tandem.operator.scaling import clamp_to_limits, planner_limits
from tandem.operator.sizing import PoolSizes
from tandem.operator.status import fleet_gpus
from tandem.operator.validation import SpecError, validate_spec

DEPLOYMENTS = "apps/v1/deployments"
OWNER = Owner("smollm2", "llm", "0f0e0d0c-0000-4000-8000-000000000001")
GPU = devices.GPU_RESOURCE


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())["spec"]


def _decode_tp2(**decode) -> dict:
    """The example (1 prefill, 3 decode, 1 GPU each named) with decode at TP 2 and its GPU count left out."""
    spec = _example()
    del spec["decode"]["resources"]["limits"][GPU]
    spec["decode"].update({"tensorParallelSize": 2, **decode})
    return spec


def _pods(raw_spec: dict) -> dict[str, dict]:
    spec, sizes = validate_spec(raw_spec, OWNER.name)
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in build_objects(OWNER, spec, sizes)
            if o["kind"] == "Deployment"}


def _worker(pod: dict) -> dict:
    return pod["containers"][0]


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _worker(pod)["env"]}


def _shm(pod: dict) -> dict:
    return next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]


def _tp_arg(pod: dict) -> str | None:
    args = _worker(pod)["args"]
    return args[args.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in args else None


def _spec_schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_takes_a_tensor_parallel_size_per_pool():
    schema = jsonschema.Draft4Validator(_spec_schema())
    schema.validate(_decode_tp2(tensorParallelSize=4))
    for bad in (0, 17, "2"):
        with pytest.raises(jsonschema.ValidationError):
            schema.validate(_decode_tp2(tensorParallelSize=bad))


def test_each_pool_runs_its_own_tensor_parallel_size():
    pods = _pods(_decode_tp2())
    prefill, decode = pods["smollm2-prefill"], pods["smollm2-decode"]
    assert (_tp_arg(prefill), _tp_arg(decode)) == (None, "2")
    # The GPUs the prefill pool names stay as written; decode names none and gets one per rank, in both buckets.
    assert _worker(prefill)["resources"]["limits"][GPU] == 1 and GPU not in _worker(prefill)["resources"]["requests"]
    assert _worker(decode)["resources"]["limits"][GPU] == _worker(decode)["resources"]["requests"][GPU] == 2
    assert _worker(decode)["resources"]["limits"]["cpu"] == "8"  # the rest as written
    assert _shm(prefill) == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert _shm(decode) == {"medium": "Memory", "sizeLimit": "3Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in _worker(decode)["volumeMounts"]
    assert _env(decode)["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG" not in _env(prefill)


def test_the_engine_tensor_parallel_size_is_the_pools_default():
    spec = _example()
    for pool in ("prefill", "decode"):
        del spec[pool]["resources"]["limits"][GPU]
    spec["engine"]["tensorParallelSize"] = 4
    spec["prefill"]["tensorParallelSize"] = 1
    pods = _pods(spec)
    assert (_tp_arg(pods["smollm2-prefill"]), _tp_arg(pods["smollm2-decode"])) == (None, "4")
    # No pool names a GPU: the workers run on CPU, with no GPU asked for and no NCCL env.
    assert GPU not in _worker(pods["smollm2-decode"])["resources"]["limits"]
    assert "NCCL_DEBUG" not in _env(pods["smollm2-decode"])
    assert _shm(pods["smollm2-decode"])["sizeLimit"] == "5Gi"


def test_the_users_nccl_env_wins_over_the_defaults():
    pods = _pods(_decode_tp2(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_IB_DISABLE", "value": "1"}]))
    env = _worker(pods["smollm2-decode"])["env"]
    assert [e["value"] for e in env if e["name"] == "NCCL_DEBUG"] == ["INFO"]
    assert {"name": "NCCL_IB_DISABLE", "value": "1"} in env


def test_a_gpu_count_below_the_pools_tensor_parallel_size_is_refused():
    spec = _example()
    spec["decode"]["tensorParallelSize"] = 4  # decode still names 1 GPU
    with pytest.raises(SpecError) as refused:
        validate_spec(spec, "smollm2")
    assert str(refused.value).count("tensorParallelSize") == 1
    assert (f"spec.decode.resources: 1 {GPU} cannot hold tensorParallelSize 4 (one GPU per rank): ask for 4, or "
            f"leave {GPU} out for the operator to ask") in str(refused.value)
    spec["decode"]["resources"]["limits"][GPU] = 4
    validate_spec(spec, "smollm2")


def test_status_and_planner_count_replicas_times_tensor_parallel_size_per_pool():
    spec, sizes = validate_spec(_decode_tp2(), "smollm2")
    assert fleet_gpus(spec, sizes) == 1 * 1 + 3 * 2
    cpu = _example()
    for pool in ("prefill", "decode"):
        del cpu[pool]["resources"]["limits"][GPU]
    assert fleet_gpus(*validate_spec(cpu, "smollm2")) is None

    raw = _decode_tp2()
    raw["scaling"] = {"mode": "planner", "gpuBudget": 9, "prefill": {"min": 1, "max": 8},
                      "decode": {"min": 1, "max": 8}}
    limits = planner_limits(validate_spec(raw, "smollm2")[0])
    assert (limits.prefill_gpus_per_replica, limits.decode_gpus_per_replica) == (1, 2)
    # 4 + 4 replicas hold 4 + 8 = 12 GPUs: shrunk by one factor to 3 prefill, and decode takes the 6 GPUs left.
    assert clamp_to_limits(4, 4, limits) == PoolSizes(3, 3)
    assert clamp_to_limits(1, 8, limits) == PoolSizes(1, 4)
    assert clamp_to_limits(2, 3, limits) == PoolSizes(2, 3)  # 8 GPUs fit

    # On CPU the budget counts ranks.
    cpu["decode"]["tensorParallelSize"] = 3
    cpu["scaling"] = copy.deepcopy(raw["scaling"])
    limits = planner_limits(validate_spec(cpu, "smollm2")[0])
    assert (limits.prefill_gpus_per_replica, limits.decode_gpus_per_replica) == (1, 3)


def _conditions(cluster) -> dict[str, dict]:
    status = (cluster.get(CR, "smollm2") or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


async def test_the_operator_gives_each_pool_its_tensor_parallel_pods(cluster):
    spec = _decode_tp2(env=[{"name": "NCCL_DEBUG", "value": "INFO"}])
    await cluster.apply_example(decode=spec["decode"])
    await cluster.wait_for("both pools", lambda: {"smollm2-prefill", "smollm2-decode"} <= set(cluster.all(DEPLOYMENTS)))
    pods = {name: cluster.get(DEPLOYMENTS, f"smollm2-{name}")["spec"]["template"]["spec"]
            for name in ("prefill", "decode")}
    assert (_tp_arg(pods["prefill"]), _tp_arg(pods["decode"])) == (None, "2")
    assert (_worker(pods["prefill"])["resources"]["limits"][GPU], _worker(pods["decode"])["resources"]["limits"][GPU]) \
        == (1, 2)
    assert (_shm(pods["prefill"])["sizeLimit"], _shm(pods["decode"])["sizeLimit"]) == ("2Gi", "3Gi")
    assert [e["value"] for e in _worker(pods["decode"])["env"] if e["name"] == "NCCL_DEBUG"] == ["INFO"]
    status = await cluster.wait_for("status.gpus", lambda: (cluster.get(CR, "smollm2").get("status") or {}).get("gpus"))
    assert status == 7  # 1 prefill x 1 GPU + 3 decode x 2

    # One more decode worker: two more GPUs.
    await cluster.patch(CR, "smollm2", {"spec": {"replicas": 5, "ratio": "1:4"}})
    await cluster.wait_for("status.gpus 9", lambda: cluster.get(CR, "smollm2")["status"].get("gpus") == 9)


async def test_the_operator_refuses_a_pool_with_fewer_gpus_than_ranks(cluster):
    await cluster.apply_example(engine={"tensorParallelSize": 2})  # each pool still names 1 GPU
    await cluster.wait_for("SpecValid=False", lambda: _conditions(cluster).get("SpecValid", {}).get("status") == "False")
    message = _conditions(cluster)["SpecValid"]["message"]
    for pool in ("prefill", "decode"):
        assert f"spec.{pool}.resources: 1 {GPU} cannot hold tensorParallelSize 2" in message
    assert _conditions(cluster)["SpecValid"]["reason"] == "InvalidSpec"
    assert cluster.all(DEPLOYMENTS) == {}
