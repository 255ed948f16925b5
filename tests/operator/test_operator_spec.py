"""P:D sizing, spec validation messages and the status computed from observed Deployments (pure functions)."""

from __future__ import annotations

import pytest
import yaml
from kube_emulator import EXAMPLE

from tandem.operator.devices import worker_gpus
from tandem.operator.sizing import PoolSizes, parse_ratio, split_by_ratio
from tandem.operator.status import compute_status, router_endpoint
from tandem.operator.validation import SpecError, validate_spec


@pytest.mark.parametrize(("total", "ratio", "expected"), [
    (4, "1:3", (1, 3)), (8, "1:3", (2, 6)), (10, "1:3", (3, 7)), (6, "1:1", (3, 3)), (6, "1:2", (2, 4)),
    (2, "1:9", (1, 1)), (3, "9:1", (2, 1)), (100, "2:3", (40, 60)), (7, "3:4", (3, 4)),
])
def test_split_by_ratio(total, ratio, expected):
    sizes = split_by_ratio(total, ratio)
    assert (sizes.prefill, sizes.decode) == expected
    assert sizes.prefill + sizes.decode == total


@pytest.mark.parametrize("bad", ["1", "0:1", "1:0", "a:b", "1:2:3", " 1:2", "-1:2", ""])
def test_bad_ratios_say_what_a_ratio_looks_like(bad):
    with pytest.raises(ValueError, match="must look like 'P:D'"):
        parse_ratio(bad)


def test_too_few_replicas_for_two_pools():
    with pytest.raises(ValueError, match="at least 2"):
        split_by_ratio(1, "1:1")


def _spec(**changes) -> dict:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec.update(changes)
    return spec


@pytest.mark.parametrize(("name", "spec", "reason"), [
    ("smollm2", _spec(replicas=1), "spec.replicas: Input should be greater than or equal to 2"),
    ("smollm2", _spec(ratio="1:three"), "spec.ratio: String should match pattern"),
    ("smollm2", _spec(image=""), "spec.image: String should have at least 1 character"),
    ("smollm2", _spec(bogus=1), "spec.bogus: Extra inputs are not permitted"),
    ("smollm2", _spec(ratio=None, replicas=None, prefill={"replicas": 1}, decode={"replicas": 0}),
     "spec.decode.replicas: must be at least 1"),
    ("smollm2", _spec(prefill={"resources": {"limits": {"memory": "lots"}}}),
     "'lots' is not a Kubernetes quantity"),
    ("smollm2", _spec(decode={"resources": {"limits": {"nvidia.com/gpu": "500m"}}}),
     "spec.decode.resources: nvidia.com/gpu '500m' is not a whole number of GPUs"),
    # The pod fields passed through as written, against the Kubernetes schema.
    ("smollm2", _spec(decode={"tolerations": [{"key": "gpu", "tolerationSeconds": "abc"}]}),
     "spec.decode.tolerations[0].tolerationSeconds: 'abc' is not of type 'integer'"),
    ("smollm2", _spec(router={"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}}),
     "spec.router.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: 'nodeSelectorTerms' is a "
     "required property"),
    ("smollm2", _spec(prefill={"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": 3}}}]}),
     "spec.prefill.env[0].valueFrom.fieldRef.fieldPath: 3 is not of type 'string'"),
    # Engine pass-through fields and LoRA adapters.
    ("smollm2", _spec(engine={"kvCacheDtype": "int4"}), "spec.engine.kvCacheDtype: Input should be"),
    ("smollm2", _spec(engine={"quantization": "awq"}), "spec.engine.quantization: Input should be 'fp8'"),
    ("smollm2", _spec(engine={"speculativeConfig": {"method": "eagle", "numSpeculativeTokens": 2}}),
     "spec.engine.speculativeConfig.method: Input should be 'ngram'"),
    ("smollm2", _spec(engine={"speculativeConfig": {"numSpeculativeTokens": 64}}),
     "spec.engine.speculativeConfig.numSpeculativeTokens: Input should be less than or equal to 32"),
    ("smollm2", _spec(engine={"speculativeConfig": {"numSpeculativeTokens": 4, "promptLookupMin": 5,
                                                    "promptLookupMax": 2}}),
     "promptLookupMin must not exceed promptLookupMax"),
    ("smollm2", _spec(loraAdapters=[{"name": "a", "source": {}}]),
     "spec.loraAdapters.0.source: loraAdapters[].source needs exactly one of pvc or hostPath"),
    ("smollm2", _spec(loraAdapters=[{"name": "a=b", "source": {"hostPath": {"path": "/a"}}}]),
     "spec.loraAdapters.0.name: String should match pattern"),
    ("smollm2", _spec(loraAdapters=[{"name": "a", "source": {"hostPath": {"path": "/a"}}}] * 2),
     "spec.loraAdapters: adapter names must be unique: a given more than once"),
    ("smollm2", _spec(loraAdapters=[{"name": "smollm2-135m-instruct", "source": {"hostPath": {"path": "/a"}}}]),
     "loraAdapters: an adapter's name must differ from model.name"),
    ("smollm2", _spec(engine={"tensorParallelSize": 2}, loraAdapters=[{"name": "a", "source": {
        "hostPath": {"path": "/a"}}}]), "spec.loraAdapters: LoRA adapters need tensorParallelSize 1"),
    ("Bad_Name", _spec(), "metadata.name: 'Bad_Name' must be a DNS-1035 label"),
    ("x" * 60, _spec(), "is 60 characters; at most 55"),
])
def test_invalid_specs_give_reasons_naming_the_field(name, spec, reason):
    with pytest.raises(SpecError) as info:
        validate_spec(spec, name)
    assert any(reason in r for r in info.value.reasons), info.value.reasons


def test_a_pod_field_newer_than_the_operators_schema_is_left_to_the_api_server():
    """Not strict: a field the bundled schema does not know may be one of a newer Kubernetes."""
    validate_spec(_spec(decode={"tolerations": [{"key": "gpu", "operator": "Exists", "fromTheFuture": 1}]}),
                  "smollm2")


@pytest.mark.parametrize(("quantity", "gpus"), [("1", 1), ("1.0", 1), ("1e0", 1), ("2000m", 2)])
def test_gpu_quantities_in_any_spelling_count_whole_gpus(quantity, gpus):
    spec, _ = validate_spec(_spec(prefill={"resources": {"limits": {"nvidia.com/gpu": quantity}}}), "smollm2")
    assert worker_gpus(spec, "prefill") == gpus


def test_valid_example_resolves_sizes():
    spec, sizes = validate_spec(_spec(), "smollm2")
    assert sizes == PoolSizes(prefill=1, decode=3)
    assert spec.router.replicas == 2 and spec.kv_transfer.ucx_transports == ["rc", "cuda_copy", "cuda_ipc", "tcp"]


def _resource(**status) -> dict:
    return {"metadata": {"name": "smollm2", "namespace": "llm", "generation": 3}, "spec": _spec(), "status": status}


def _deployment(replicas: int, ready: int, reason: str = "NewReplicaSetAvailable", generation: int = 1,
                observed: int = 1) -> dict:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": replicas,
                       "readyReplicas": ready, "availableReplicas": ready,
                       "conditions": [{"type": "Progressing", "status": "True", "reason": reason}]}}


def test_status_before_anything_exists_is_pending():
    status = compute_status(_resource(), {}, None, "2026-01-01T00:00:00Z", generation=3)
    assert (status["phase"], status["ready"], status["ratio"], status["endpoint"]) == ("Pending", "0/6", "0:0", None)
    assert status["observedGeneration"] == 3


def test_status_ready_and_transition_times_only_move_on_flips():
    deployments = {"prefill": _deployment(1, 1), "decode": _deployment(3, 3), "router": _deployment(2, 2)}
    first = compute_status(_resource(), deployments, None, "t1", generation=3)
    assert first["phase"] == "Ready"
    later = compute_status(_resource(**first), deployments, None, "t2")
    assert later == first  # nothing flipped: same times, same observedGeneration
    deployments["decode"] = _deployment(3, 2)
    degraded = compute_status(_resource(**later), deployments, None, "t3")
    times = {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}
    assert times == {"SpecValid": "t1", "Ready": "t3", "Progressing": "t1", "Degraded": "t3"}


def test_status_a_scale_up_under_way_is_progressing_until_a_pod_it_started_with_is_lost():
    """A Deployment controller keeps Progressing=True NewReplicaSetAvailable when only the replicas change, so the
    counts alone cannot tell new pods loading (minutes, for a model) from pods lost: the status remembers where a
    scale-up started."""
    deployments = {"prefill": _deployment(1, 1), "decode": _deployment(3, 3), "router": _deployment(2, 2)}
    ready = compute_status(_resource(), deployments, None, "t1", generation=3)
    assert ready["phase"] == "Ready"

    def scaled(status):  # the spec asks for 8 workers at 1:3: 2 prefill, 6 decode
        resource = _resource(**status)
        resource["spec"]["replicas"] = 8
        resource["metadata"]["generation"] = 4
        return resource

    def conditions(status):
        return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}

    deployments.update(prefill=_deployment(2, 1, generation=2, observed=2),
                       decode=_deployment(6, 3, generation=2, observed=2))
    scaling = compute_status(scaled(ready), deployments, None, "t2", generation=4)
    assert scaling["phase"] == "Progressing"
    assert conditions(scaling)["Progressing"] == ("True", "ScalingUp")
    assert conditions(scaling)["Degraded"] == ("False", "AsExpected")
    assert (scaling["prefill"]["scaleUpFrom"], scaling["decode"]["scaleUpFrom"]) == (1, 3)
    deployments["decode"] = _deployment(6, 5, generation=2, observed=2)
    later = compute_status(scaled(scaling), deployments, None, "t3")
    assert later["phase"] == "Progressing" and later["decode"]["scaleUpFrom"] == 3

    deployments["decode"] = _deployment(6, 2, generation=2, observed=2)  # one of the three it started with is lost
    lost = compute_status(scaled(later), deployments, None, "t4")
    assert lost["phase"] == "Degraded" and conditions(lost)["Degraded"] == ("True", "ReplicasUnavailable")

    deployments.update(prefill=_deployment(2, 2, generation=2, observed=2),
                       decode=_deployment(6, 6, generation=2, observed=2))
    done = compute_status(scaled(lost), deployments, None, "t5")
    assert done["phase"] == "Ready" and done["decode"]["scaleUpFrom"] is None
    assert conditions(done)["Progressing"] == ("False", "Idle")


def test_status_a_deployment_behind_its_generation_is_progressing():
    deployments = {"prefill": _deployment(1, 1, generation=2, observed=1), "decode": _deployment(3, 3),
                   "router": _deployment(2, 2)}
    assert compute_status(_resource(), deployments, None, "t")["phase"] == "Progressing"


def test_status_of_an_invalid_spec():
    resource = _resource()
    resource["spec"]["replicas"] = None
    status = compute_status(resource, {}, None, "t", generation=4)
    assert status["phase"] == "Invalid"
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and "spec.ratio needs spec.replicas" in spec_valid["message"]


def test_status_of_a_spec_that_failed_to_apply_is_not_ready_whatever_the_last_one_runs():
    """A foreign object (or a 403, or a webhook) stops generation 4 from being applied: what runs is generation 3's.
    Ready=True then would tell a `kubectl wait --for=condition=Ready` that a new image is live when it is not."""
    from tandem.operator.status import Problem

    deployments = {"prefill": _deployment(1, 1), "decode": _deployment(3, 3), "router": _deployment(2, 2)}
    applied = compute_status(_resource(), deployments, None, "t1", generation=3)
    assert applied["phase"] == "Ready"
    resource = _resource(**applied)
    resource["metadata"]["generation"] = 4
    failed = compute_status(resource, deployments, None, "t2", problem=Problem(False, "PodDisruptionBudget taken"))
    conditions = {c["type"]: c for c in failed["conditions"]}
    assert failed["phase"] == "Degraded" and failed["observedGeneration"] == 3
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "SpecNotApplied"
    assert "generation 4 is not applied yet" in conditions["Ready"]["message"]
    assert conditions["Degraded"]["reason"] == "ApplyFailed"


def test_status_of_an_invalid_spec_says_a_deployment_deleted_meanwhile_is_missing():
    """Under an invalid spec nothing is applied, so a deleted router stays deleted until the spec is fixed: the status
    must say so, not count it as 0 of 0 wanted."""
    deployments = {"prefill": _deployment(1, 1), "decode": _deployment(3, 3), "router": _deployment(2, 2)}
    resource = _resource(**compute_status(_resource(), deployments, None, "t1", generation=3))
    resource["spec"]["replicas"] = None  # invalid from generation 4 on
    del deployments["router"]
    status = compute_status(resource, deployments, None, "t2", generation=4)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Invalid" and status["router"] == {"desired": 2, "ready": 0, "updated": 0,
                                                                    "scaleUpFrom": None}
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "DeploymentMissing"
    assert "the router Deployment is missing" in conditions["Degraded"]["message"]


def test_router_endpoint_prefers_the_load_balancer_address():
    service = {"metadata": {"name": "smollm2-router", "namespace": "llm"},
               "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}}
    assert router_endpoint(service) == "http://smollm2-router.llm.svc:80"
    service["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}
    assert router_endpoint(service) == "http://203.0.113.7:80"
