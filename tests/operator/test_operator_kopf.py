"""The real kopf operator against kmock's emulated API server: what `kubectl apply` of the example does."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import kmock
import kubernetes.client
import pytest
import yaml
from kube_emulator import CR, EXAMPLE, PDBS, Cluster, foreign_disruption_budget

from tandem.operator import names
from tandem.operator.builders import Owner, build_objects
from tandem.operator.kube import Kube, KubeError, with_desired_hash
from tandem.operator.main import peering_priority
from tandem.operator.reconcile import reconcile
from tandem.operator.validation import validate_spec

DEPLOYMENTS = "apps/v1/deployments"
OWNED = {
    "apps/v1/deployments": {"smollm2-prefill", "smollm2-decode", "smollm2-router"},
    "v1/services": {"smollm2-prefill", "smollm2-decode", "smollm2-router"},
    "v1/configmaps": {"smollm2-config"},
    "v1/serviceaccounts": {"smollm2-router"},
    "rbac.authorization.k8s.io/v1/roles": {"smollm2-router-discovery"},
    "rbac.authorization.k8s.io/v1/rolebindings": {"smollm2-router-discovery"},
    "policy/v1/poddisruptionbudgets": {"smollm2-prefill", "smollm2-decode", "smollm2-router"},
}


def _args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


async def _all_owned(cluster, timeout: float = 10.0) -> None:
    await cluster.wait_for("every owned object", lambda: all(
        set(cluster.all(resource)) >= expected for resource, expected in OWNED.items()), timeout)


async def test_example_creates_pools_router_services_config_and_rbac(cluster):
    cr = await cluster.apply_example()
    await _all_owned(cluster)
    uid = cr["metadata"]["uid"]
    deployments = cluster.all(DEPLOYMENTS)

    # 4 workers at 1:3 -> 1 prefill, 3 decode; 2 routers, as examples/llmdeployment.yaml asks.
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == {
        "smollm2-prefill": 1, "smollm2-decode": 3, "smollm2-router": 2}
    for pool in ("prefill", "decode"):
        container = deployments[f"smollm2-{pool}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "tandem/worker:0.1.0"
        assert container["command"] == ["tandem"]
        args = container["args"]
        assert args[0] == "worker" and _flag(args, "--role") == pool
        assert _flag(args, "--model") == "smollm2"
        assert _flag(args, "--served-model-name") == "smollm2-135m-instruct"
        assert (_flag(args, "--dtype"), _flag(args, "--max-model-len"), _flag(args, "--block-size")) == (
            "bfloat16", "8192", "16")
        assert _flag(args, "--kv-transfer") == "nixl" and _flag(args, "--kv-transfer-lanes") == "2"
        assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc,tcp"} in container["env"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["lifecycle"]["preStop"]["exec"]["command"][:2] == ["tandem", "drain"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True

    router = deployments["smollm2-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert router["containers"][0]["image"] == "tandem/slim:0.1.0"
    assert args[0] == "router" and _flag(args, "--discovery") == "kubernetes"
    assert _flag(args, "--namespace") == "ns1"
    assert _flag(args, "--prefill-selector") == "kubernetes.io/service-name=smollm2-prefill"
    assert _flag(args, "--decode-selector") == "kubernetes.io/service-name=smollm2-decode"
    assert _flag(args, "--disagg-min-tokens") == "256"
    assert _flag(args, "--key-eps") == "0.25"  # two router replicas: looser key bound, more agreement
    assert router["serviceAccountName"] == "smollm2-router"

    services = cluster.all("v1/services")
    assert services["smollm2-router"]["spec"]["type"] == "ClusterIP"
    assert services["smollm2-router"]["spec"]["ports"][0]["port"] == 8000
    assert services["smollm2-prefill"]["spec"]["clusterIP"] == "None"
    assert services["smollm2-decode"]["spec"]["clusterIP"] == "None"
    config = cluster.get("v1/configmaps", "smollm2-config")
    assert '"interactive"' in config["data"]["slo-classes.json"]
    role = cluster.get("rbac.authorization.k8s.io/v1/roles", "smollm2-router-discovery")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = cluster.get("rbac.authorization.k8s.io/v1/rolebindings", "smollm2-router-discovery")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "smollm2-router", "namespace": "ns1"}]

    # The internal endpoints' token: one Secret, owned, read by the router and both pools from the same key.
    secret = cluster.get("v1/secrets", "smollm2-internal")
    token = token_of(secret)
    assert token and len(token) >= 32 and secret["metadata"]["ownerReferences"][0]["uid"] == uid
    token_env = {"name": "TANDEM_INTERNAL_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": "smollm2-internal", "key": "token"}}}
    for name in ("smollm2-prefill", "smollm2-decode", "smollm2-router"):
        assert token_env in deployments[name]["spec"]["template"]["spec"]["containers"][0]["env"]

    # Everything is owned by the LLMDeployment (garbage-collected with it) and is exactly what the
    # builders produce for this spec.
    spec, sizes = validate_spec(yaml.safe_load(EXAMPLE.read_text())["spec"], "smollm2")
    secret_uid = cluster.get("v1/secrets", "smollm2-internal")["metadata"]["uid"]
    for expected in build_objects(Owner("smollm2", "ns1", uid), spec, sizes, secret_uid):
        resource = next(r for r in OWNED if r.endswith("/" + expected["kind"].lower() + "s")
                        or (expected["kind"] == "PodDisruptionBudget" and r.endswith("poddisruptionbudgets")))
        stored = cluster.get(resource, expected["metadata"]["name"])
        assert stored["metadata"]["ownerReferences"] == [{
            "apiVersion": "serving.tandem.dev/v1alpha1", "kind": "LLMDeployment", "name": "smollm2", "uid": uid,
            "controller": True, "blockOwnerDeletion": True}]
        for key, value in with_desired_hash(expected).items():
            if key != "metadata":
                assert stored[key] == value, f"{expected['kind']} {key}"
        assert stored["metadata"]["annotations"] == with_desired_hash(expected)["metadata"]["annotations"]

    created = await cluster.wait_for("13 Created events", lambda: len(cluster.events("Created")) >= 13
                                     and cluster.events("Created"))
    assert len(created) == 13
    assert {e["involvedObject"]["name"] for e in created} == {"smollm2"}
    # The spec handler's refresh records the generation; a refresh for an owned object's event may come first.
    status = await cluster.wait_for("a status of generation 1", lambda: (
        (cluster.get(CR, "smollm2") or {}).get("status") or {}).get("observedGeneration") == 1
        and cluster.get(CR, "smollm2")["status"])
    assert status["observedGeneration"] == 1
    assert status["phase"] == "Progressing"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "SpecValid": "True", "Ready": "False", "Progressing": "True", "Degraded": "False"}
    assert status["endpoint"] == "http://smollm2-router.ns1.svc:8000"


async def test_changing_the_ratio_patches_replicas(cluster):
    await cluster.apply_example()
    await _all_owned(cluster)
    token = cluster.get("v1/secrets", "smollm2-internal")
    await cluster.patch(CR, "smollm2", {"spec": {"ratio": "1:2", "replicas": 6}})

    def resized():
        replicas = {n: d["spec"]["replicas"] for n, d in cluster.all(DEPLOYMENTS).items()}
        return replicas if replicas == {"smollm2-prefill": 2, "smollm2-decode": 4, "smollm2-router": 2} else None

    await cluster.wait_for("2 prefill : 4 decode", resized)
    await cluster.wait_for("status of generation 2",
                           lambda: cluster.get(CR, "smollm2")["status"]["observedGeneration"] == 2)
    assert cluster.get(CR, "smollm2")["status"]["prefill"]["desired"] == 2
    # Only what the ratio touches changes: the two pools and the ConfigMap. The routers do not read the sizes,
    # so they keep running (a scaling decision must not cut their streams).
    touched = {"Deployment smollm2-prefill", "Deployment smollm2-decode", "ConfigMap smollm2-config"}
    await cluster.wait_for("Updated events", lambda: {e["message"] for e in cluster.events("Updated")} >= touched)
    await asyncio.sleep(0.3)
    assert {e["message"] for e in cluster.events("Updated")} == touched

    # An engine change rolls the workers: a new pod template.
    await cluster.patch(CR, "smollm2", {"spec": {"engine": {"maxNumSeqs": 32}}})
    await cluster.wait_for("--max-num-seqs 32 in the decode pod template", lambda: _flag(
        _args(cluster.get(DEPLOYMENTS, "smollm2-decode")), "--max-num-seqs") == "32")
    # The internal token is made once: new pods and the routers already running keep agreeing on it.
    assert cluster.get("v1/secrets", "smollm2-internal") == token


async def test_engine_pass_through_fields_and_lora_adapters_reach_both_pools(cluster):
    engine = {**yaml.safe_load(EXAMPLE.read_text())["spec"]["engine"], "quantization": "fp8", "kvCacheDtype": "fp8",
              "speculativeConfig": {"numSpeculativeTokens": 4}}
    adapters = [{"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "sql"}}},
                {"name": "chat", "source": {"hostPath": {"path": "/data/adapters/chat"}}}]
    await cluster.apply_example(engine=engine, loraAdapters=adapters)
    await _all_owned(cluster)
    for pool in ("prefill", "decode"):
        pod = cluster.get(DEPLOYMENTS, f"smollm2-{pool}")["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert (_flag(args, "--quantization"), _flag(args, "--kv-cache-dtype")) == ("fp8", "fp8")
        assert _flag(args, "--speculative-config") == '{"method":"ngram","num_speculative_tokens":4}'
        assert "--enable-lora" in args
        assert args[args.index("--lora-modules") + 1:][:2] == ["sql=/loras/pvc-0/sql", "chat=/loras/host-1"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["lora-pvc-0"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        assert volumes["lora-host-1"]["hostPath"] == {"path": "/data/adapters/chat", "type": "Directory"}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["lora-pvc-0"] == {"name": "lora-pvc-0", "mountPath": "/loras/pvc-0", "readOnly": True}
        assert mounts["lora-host-1"] == {"name": "lora-host-1", "mountPath": "/loras/host-1", "readOnly": True}
    assert "--enable-lora" not in _args(cluster.get(DEPLOYMENTS, "smollm2-router"))


def _deployment_status(replicas: int, ready: int, progressing: str = "NewReplicaSetAvailable",
                       progressing_status: str = "True", generation: int = 1) -> dict:
    """What the Deployment controller writes: every pod on the new template, `ready` of them ready."""
    return {"status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
                       "readyReplicas": ready, "availableReplicas": ready,
                       "conditions": [{"type": "Progressing", "status": progressing_status, "reason": progressing}]}}


async def test_deployment_statuses_move_the_resource_to_ready(cluster):
    await cluster.apply_example()
    await _all_owned(cluster)

    def status_with(**expected):
        status = (cluster.get(CR, "smollm2") or {}).get("status") or {}
        return status if all(status.get(k) == v for k, v in expected.items()) else None

    # Starting up: pods exist, models still loading.
    await cluster.patch(DEPLOYMENTS, "smollm2-prefill", _deployment_status(1, 1), subresource="status")
    await cluster.patch(DEPLOYMENTS, "smollm2-decode", _deployment_status(3, 2, "ReplicaSetUpdated"),
                        subresource="status")
    status = await cluster.wait_for("2 of 3 decode workers up", lambda: status_with(ready="3/6", ratio="1:2"))
    assert status["decode"] == {"desired": 3, "ready": 2, "updated": 3}
    assert status["phase"] == "Progressing"

    await cluster.patch(DEPLOYMENTS, "smollm2-decode", _deployment_status(3, 3), subresource="status")
    await cluster.patch(DEPLOYMENTS, "smollm2-router", _deployment_status(2, 2), subresource="status")
    status = await cluster.wait_for("Ready", lambda: status_with(phase="Ready"))
    assert (status["ready"], status["ratio"]) == ("6/6", "1:3")
    assert status["prefill"] == {"desired": 1, "ready": 1, "updated": 1}
    assert status["router"] == {"desired": 2, "ready": 2, "updated": 2}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "SpecValid": "True", "Ready": "True", "Progressing": "False", "Degraded": "False"}
    assert status["endpoint"] == "http://smollm2-router.ns1.svc:8000"

    # A decode pod dies after the rollout finished: serving, but degraded.
    await cluster.patch(DEPLOYMENTS, "smollm2-decode", _deployment_status(3, 2), subresource="status")
    status = await cluster.wait_for("Degraded", lambda: status_with(phase="Degraded", ratio="1:2"))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReplicasUnavailable")

    # The controller gives up on a rollout: degraded with its reason.
    await cluster.patch(DEPLOYMENTS, "smollm2-decode",
                        _deployment_status(3, 1, "ProgressDeadlineExceeded", progressing_status="False"),
                        subresource="status")
    status = await cluster.wait_for("RolloutStalled", lambda: status_with(phase="Degraded", ratio="1:1"))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "RolloutStalled" and "decode: ProgressDeadlineExceeded" in degraded["message"]


async def test_a_scale_up_under_way_is_progressing_not_degraded(cluster):
    """A real Deployment controller keeps Progressing=True NewReplicaSetAvailable when only the replicas change (the
    emulator's too): the new pods load the model for minutes meanwhile, and that is no failure."""
    await cluster.apply_example()
    await _all_owned(cluster)
    for name, replicas in (("smollm2-prefill", 1), ("smollm2-decode", 3), ("smollm2-router", 2)):
        await cluster.patch(DEPLOYMENTS, name, _deployment_status(replicas, replicas), subresource="status")
    await cluster.wait_for("Ready", lambda: (cluster.get(CR, "smollm2").get("status") or {}).get("phase") == "Ready")

    await cluster.patch(CR, "smollm2", {"spec": {"replicas": 8}})  # 1:3 of 8: 2 prefill, 6 decode
    await cluster.wait_for("the decode scale-up seen by the Deployment controller", lambda: (
        cluster.get(DEPLOYMENTS, "smollm2-decode")["status"]["replicas"] == 6))
    decode = cluster.get(DEPLOYMENTS, "smollm2-decode")
    assert decode["status"]["observedGeneration"] == decode["metadata"]["generation"] == 2
    assert decode["status"]["readyReplicas"] == 3
    assert decode["status"]["conditions"][0]["reason"] == "NewReplicaSetAvailable"
    await cluster.wait_for("Progressing=True ScalingUp", lambda: _conditions(cluster)["Progressing"]["reason"] == "ScalingUp")
    status = cluster.get(CR, "smollm2")["status"]
    assert status["phase"] == "Progressing" and status["decode"]["scaleUpFrom"] == 3
    assert (_conditions(cluster)["Degraded"]["status"], _conditions(cluster)["Progressing"]["status"]) == ("False", "True")

    for name, replicas in (("smollm2-prefill", 2), ("smollm2-decode", 6)):
        await cluster.patch(DEPLOYMENTS, name, _deployment_status(replicas, replicas, generation=2),
                            subresource="status")
    await cluster.wait_for("Ready at 8", lambda: cluster.get(CR, "smollm2")["status"]["phase"] == "Ready")
    assert cluster.get(CR, "smollm2")["status"]["ready"] == "10/10"


def _replicas(cluster) -> dict[str, int]:
    return {n: d["spec"]["replicas"] for n, d in cluster.all(DEPLOYMENTS).items()}


async def test_a_scale_through_the_scale_subresource_keeps_the_ratio(cluster):
    """`kubectl scale llmdeployment smollm2 --replicas N` (or an HPA) writes the Scale's spec.replicas, which the
    CRD's scale subresource maps onto spec.replicas: the total the ratio splits. kmock has no Scale objects: it
    merges the Scale's body into the resource, which is where specReplicasPath puts it (the emulator bumps the
    generation, as a real API server does for a write of the scale subresource)."""
    await cluster.apply_example()
    await _all_owned(cluster)
    for total, prefill, decode in ((8, 2, 6), (12, 3, 9), (4, 1, 3)):  # 1:3, prefill rounded half up
        await cluster.patch(CR, "smollm2", {"spec": {"replicas": total}}, subresource="scale")
        await cluster.wait_for(f"{prefill} prefill : {decode} decode", lambda p=prefill, d=decode: _replicas(
            cluster) == {"smollm2-prefill": p, "smollm2-decode": d, "smollm2-router": 2})
        await cluster.wait_for(f"status.replicas {total}", lambda t=total: (
            cluster.get(CR, "smollm2").get("status") or {}).get("replicas") == t)
    assert cluster.get(CR, "smollm2")["spec"]["ratio"] == "1:3"
    assert cluster.get(CR, "smollm2")["status"]["selector"] == (
        "app.kubernetes.io/name=tandem,app.kubernetes.io/instance=smollm2,"
        "app.kubernetes.io/component in (prefill,decode)")


async def test_replicas_set_by_someone_else_hold_until_the_operator_asks_for_another_number(cluster):
    """An autoscaler of one pool's Deployment (or `kubectl scale deployment`) is not fought: neither a change of the
    pod template nor a resync (a forced apply) puts the operator's number back; a new number of its own does."""
    cr = await cluster.apply_example()
    await _all_owned(cluster)
    await cluster.patch(DEPLOYMENTS, "smollm2-decode", {"spec": {"replicas": 5}})
    await cluster.patch(CR, "smollm2", {"spec": {"engine": {"maxNumSeqs": 32}}})
    await cluster.wait_for("--max-num-seqs 32 in the decode pod template", lambda: _flag(
        _args(cluster.get(DEPLOYMENTS, "smollm2-decode")), "--max-num-seqs") == "32")
    assert _replicas(cluster)["smollm2-decode"] == 5
    assert cluster.get(DEPLOYMENTS, "smollm2-decode")["metadata"]["annotations"]["serving.tandem.dev/replicas"] == "3"
    await cluster.wait_for("status: 5 decode workers desired", lambda: (
        (cluster.get(CR, "smollm2").get("status") or {}).get("decode") or {}).get("desired") == 5)

    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(cluster.emulator.url).rstrip("/")))
    try:  # what the resync timer does (off in these tests): every object applied again, with force
        outcomes = await asyncio.to_thread(reconcile, Kube(api), cluster.get(CR, "smollm2"), True)
    finally:
        api.close()
    applied = {obj["metadata"]["name"]: obj for _, obj in outcomes if obj["kind"] == "Deployment"}
    assert applied["smollm2-decode"]["spec"]["replicas"] == 5 and _replicas(cluster)["smollm2-decode"] == 5

    await cluster.patch(CR, "smollm2", {"spec": {"replicas": 8}})  # the operator's number changes: 2 + 6
    await cluster.wait_for("2 prefill : 6 decode", lambda: _replicas(cluster) == {
        "smollm2-prefill": 2, "smollm2-decode": 6, "smollm2-router": 2})
    assert cr["metadata"]["uid"] == cluster.get(CR, "smollm2")["metadata"]["uid"]


async def test_invalid_spec_sets_spec_valid_false_posts_an_event_and_creates_nothing(cluster):
    await cluster.apply_example(prefill={"replicas": 2})  # a ratio and an explicit pool size at once
    status = await cluster.wait_for("SpecValid=False", lambda: (cluster.get(CR, "smollm2") or {}).get("status"))
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
    assert "spec.ratio sizes the pools: do not also set prefill.replicas" in spec_valid["message"]
    assert status["phase"] == "Invalid"
    events = await cluster.wait_for("an InvalidSpec event", lambda: cluster.events("InvalidSpec"))
    assert events[0]["type"] == "Warning" and "spec.ratio sizes the pools" in events[0]["message"]

    await asyncio.sleep(1.5)  # a retry storm would show up as more attempts within this window
    assert len(cluster.events("InvalidSpec")) == 1
    # An edit of its labels handles the same spec again: the status already says why, no second event.
    await cluster.patch(CR, "smollm2", {"metadata": {"labels": {"team": "search"}}})
    await asyncio.sleep(1.5)
    assert len(cluster.events("InvalidSpec")) == 1
    for resource in OWNED:
        assert cluster.all(resource) == {}, resource

    # Fixing the spec reconciles it: no restart, no manual retry.
    await cluster.patch(CR, "smollm2", {"spec": {"prefill": {"replicas": None}}})
    await _all_owned(cluster)
    await cluster.wait_for("SpecValid=True", lambda: {c["type"]: c["status"] for c in cluster.get(
        CR, "smollm2")["status"]["conditions"]}["SpecValid"] == "True")


def _conditions(cluster) -> dict[str, dict]:
    status = (cluster.get(CR, "smollm2") or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def _container(cluster, name: str) -> dict:
    return cluster.get(DEPLOYMENTS, name)["spec"]["template"]["spec"]["containers"][0]


async def test_a_field_of_the_wrong_type_in_a_pod_setting_is_an_invalid_spec_not_an_outage(cluster):
    """docs/kubernetes.md's own example. A real API server's server-side apply answers a field of the wrong type with
    a 500 (the emulator too), which read as an outage made the LLMDeployment Degraded and retried it every 10 s."""
    await cluster.apply_example(decode={"tolerations": [{"key": "gpu", "operator": "Exists",
                                                         "tolerationSeconds": "abc"}]})
    await cluster.wait_for("SpecValid=False", lambda: _conditions(cluster).get("SpecValid", {}).get("status") == "False")
    message = "spec.decode.tolerations[0].tolerationSeconds: 'abc' is not of type 'integer'"
    assert message in _conditions(cluster)["SpecValid"]["message"]
    events = await cluster.wait_for("an InvalidSpec event", lambda: cluster.events("InvalidSpec"))
    assert len(events) == 1 and message in events[0]["message"]
    await asyncio.sleep(1.5)
    assert len(cluster.events("InvalidSpec")) == 1 and cluster.events("ApplyFailed") == []
    assert cluster.get(CR, "smollm2")["status"]["phase"] == "Invalid"
    assert _conditions(cluster)["Degraded"]["status"] == "False"
    for resource in [*OWNED, "v1/secrets"]:
        assert cluster.all(resource) == {}, resource


async def test_the_emulator_answers_a_type_error_in_a_server_side_apply_as_kubernetes_does(emulator):
    """A 500 naming the field, dry run or not (kubernetes#139253); other schema errors stay 422s."""
    spec, sizes = validate_spec(yaml.safe_load(EXAMPLE.read_text())["spec"], "smollm2")
    deployment = build_objects(Owner("smollm2", "ns1", "uid"), spec, sizes)[-4]
    deployment["spec"]["template"]["spec"]["tolerations"] = [{"key": "gpu", "tolerationSeconds": "abc"}]
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(emulator.url).rstrip("/")))
    try:
        kube = Kube(api)
        for dry_run in (True, False):
            with pytest.raises(KubeError) as refused:
                await asyncio.to_thread(kube.apply, deployment, dry_run)
            assert refused.value.status == 500 and refused.value.invalid and not refused.value.retriable
            assert refused.value.message == (
                "failed to create typed patch object (apps/v1, Kind=Deployment): "
                ".spec.template.spec.tolerations[0].tolerationSeconds: expected numeric (int or float), got string")
        deployment["spec"]["template"]["spec"]["tolerations"] = [{"key": "gpu", "tolerationSecond": 5}]
        with pytest.raises(KubeError) as unknown:
            await asyncio.to_thread(kube.apply, deployment, True)
        assert unknown.value.status == 500 and unknown.value.message.endswith(
            ".spec.template.spec.tolerations[0].tolerationSecond: field not declared in schema")
        del deployment["spec"]["template"]["spec"]["tolerations"]
        del deployment["spec"]["selector"]  # required: refused after the patch is made, with a 422
        with pytest.raises(KubeError) as missing:
            await asyncio.to_thread(kube.create, deployment, True)
        assert missing.value.status == 422 and missing.value.invalid
    finally:
        api.close()


async def test_a_spec_the_api_server_refuses_is_applied_whole_or_not_at_all(cluster):
    """Tolerations, affinity and env entries go into the pods as written; the API server may refuse them. Each
    changed object is checked by a dry run first: no pool rolls to a spec another pool cannot take. A field the
    operator's schema check leaves to the server (one it does not know: the server may be newer) is refused by
    server-side apply with a 500, read as the refusal it is."""
    refused = {"tolerations": [{"key": "gpu", "operator": "Exists", "tolerationSecond": 30}]}
    await cluster.apply_example(decode=refused)
    await cluster.wait_for("an InvalidSpec event", lambda: cluster.events("InvalidSpec"))
    await cluster.wait_for("SpecValid=False", lambda: _conditions(cluster).get("SpecValid", {}).get("status") == "False")
    conditions = _conditions(cluster)
    assert "refuses Deployment smollm2-decode" in conditions["SpecValid"]["message"]
    assert "tolerations[0].tolerationSecond: field not declared in schema" in conditions["SpecValid"]["message"]
    for resource in [*OWNED, "v1/secrets"]:
        assert cluster.all(resource) == {}, resource  # not the prefill pool, the router, the token, or anything else

    # Valid, then a change the API server refuses: what runs stays as it was, and the status says why.
    await cluster.patch(CR, "smollm2", {"spec": {"decode": {"tolerations": None}}})
    await _all_owned(cluster)
    await cluster.patch(CR, "smollm2", {"spec": {"image": "tandem/worker:0.2.0", "decode": refused}})
    await cluster.wait_for("SpecValid=False", lambda: _conditions(cluster)["SpecValid"]["status"] == "False")
    assert _container(cluster, "smollm2-prefill")["image"] == "tandem/worker:0.1.0"
    ready = _conditions(cluster)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert (cluster.get(CR, "smollm2")["status"]["phase"]) == "Invalid"

    await cluster.patch(CR, "smollm2", {"spec": {"decode": {"tolerations": None}}})
    await cluster.wait_for("the new image everywhere", lambda: all(
        _container(cluster, f"smollm2-{pool}")["image"] == "tandem/worker:0.2.0" for pool in ("prefill", "decode")))
    await cluster.wait_for("SpecValid=True", lambda: _conditions(cluster)["SpecValid"]["status"] == "True")


async def test_an_env_name_the_operator_sets_is_refused_with_its_reason(cluster):
    await cluster.apply_example(decode={"env": [{"name": "HOME", "value": "/data"}]})
    await cluster.wait_for("SpecValid=False", lambda: _conditions(cluster).get("SpecValid", {}).get("status") == "False")
    assert "spec.decode.env: HOME is set more than once" in _conditions(cluster)["SpecValid"]["message"]
    assert cluster.all(DEPLOYMENTS) == {}


async def test_an_object_of_the_same_name_that_is_not_ours_is_left_alone(cluster):
    """Taking it over would hand it to the LLMDeployment's garbage collection."""
    theirs = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "smollm2-config", "namespace": "ns1"},
              "data": {"app.properties": "important=1"}}
    await cluster.create("v1/configmaps", theirs)
    await cluster.apply_example()
    await cluster.wait_for("an ApplyFailed event", lambda: cluster.events("ApplyFailed"))
    await cluster.wait_for("Degraded", lambda: _conditions(cluster).get("Degraded", {}).get("reason") == "ApplyFailed")
    assert "ConfigMap smollm2-config exists and does not belong" in _conditions(cluster)["Degraded"]["message"]
    config = cluster.get("v1/configmaps", "smollm2-config")
    assert not config["metadata"].get("ownerReferences") and config["data"] == theirs["data"]

    # Gone (its owner deleted it): the retry, 10 s on, creates the LLMDeployment's own.
    await cluster.delete("v1/configmaps", "smollm2-config")
    await _all_owned(cluster, timeout=25)
    await cluster.wait_for("Degraded cleared", lambda: _conditions(cluster)["Degraded"]["reason"] != "ApplyFailed",
                           timeout=20)


def token_of(secret: dict) -> str | None:
    """The token as the emulator keeps it (stringData, as posted) or as an API server would (data)."""
    return (secret.get("stringData") or {}).get("token") or (secret.get("data") or {}).get("token")


async def test_a_token_secret_made_again_rolls_the_router_and_both_pools(cluster):
    """Pods read the token when they start: a Secret deleted and made again (a new token) must restart every
    component, or old and new pods would refuse each other's internal calls for good."""
    await cluster.apply_example()
    await _all_owned(cluster)

    def secret_annotations() -> set:
        return {d["spec"]["template"]["metadata"]["annotations"].get("serving.tandem.dev/internal-secret")
                for d in cluster.all(DEPLOYMENTS).values()}

    first = cluster.get("v1/secrets", "smollm2-internal")
    assert secret_annotations() == {first["metadata"]["uid"]}
    await cluster.delete("v1/secrets", "smollm2-internal")
    await cluster.patch(CR, "smollm2", {"spec": {"engine": {"maxNumSeqs": 32}}})  # any reconcile makes it again
    await cluster.wait_for("a new Secret", lambda: (cluster.get("v1/secrets", "smollm2-internal") or {}).get(
        "metadata", {}).get("uid") not in (None, first["metadata"]["uid"]))
    again = cluster.get("v1/secrets", "smollm2-internal")
    assert token_of(again) != token_of(first)
    await cluster.wait_for("every pod template on the new Secret",
                           lambda: secret_annotations() == {again["metadata"]["uid"]})


async def test_a_deleted_config_map_or_token_secret_is_put_back_at_once(cluster):
    """The routers mount the ConfigMap and every pod reads the token Secret when it starts: new pods cannot start
    without them, so they are watched as the Deployments are, not left for the next resync (off in these tests)."""
    await cluster.apply_example()
    await _all_owned(cluster)
    config = cluster.get("v1/configmaps", "smollm2-config")
    await cluster.delete("v1/configmaps", "smollm2-config")
    await cluster.wait_for("the ConfigMap back", lambda: cluster.get("v1/configmaps", "smollm2-config"))
    assert cluster.get("v1/configmaps", "smollm2-config")["data"] == config["data"]

    first = cluster.get("v1/secrets", "smollm2-internal")["metadata"]["uid"]
    await cluster.delete("v1/secrets", "smollm2-internal")
    await cluster.wait_for("a new token Secret", lambda: (cluster.get("v1/secrets", "smollm2-internal") or {}).get(
        "metadata", {}).get("uid") not in (None, first))
    again = cluster.get("v1/secrets", "smollm2-internal")["metadata"]["uid"]
    await cluster.wait_for("every pod template on the new Secret", lambda: {
        d["spec"]["template"]["metadata"]["annotations"].get("serving.tandem.dev/internal-secret")
        for d in cluster.all(DEPLOYMENTS).values()} == {again})

    # Watched by their labels on the API server's side: the operator is sent its own ConfigMaps and Secrets only.
    reads = [r for r in cluster.emulator if r.resource in (
        kmock.resource("v1/configmaps"), kmock.resource("v1/secrets")) and r.action in (kmock.action.LIST,
                                                                                      kmock.action.WATCH)]
    assert {r.resource.plural for r in reads} == {"configmaps", "secrets"}
    assert {r.params.get("labelSelector") for r in reads} == {names.OWNED_SELECTOR}


async def test_a_token_secret_of_the_same_name_that_is_not_ours_is_not_used(cluster):
    """Its token would be whoever made it's: the deployment waits, Degraded, rather than trust it."""
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "smollm2-internal", "namespace": "ns1"},
              "stringData": {"token": "chosen-by-someone-else"}}
    await cluster.create("v1/secrets", theirs)
    await cluster.apply_example()
    await cluster.wait_for("Degraded", lambda: _conditions(cluster).get("Degraded", {}).get("reason") == "ApplyFailed")
    assert "Secret ns1/smollm2-internal exists and does not belong" in _conditions(cluster)["Degraded"]["message"]
    assert cluster.all(DEPLOYMENTS) == {}


async def test_a_deployment_deleted_with_cascade_orphan_and_made_again_adopts_its_objects_without_a_roll(cluster):
    """`kubectl delete llmdep NAME --cascade=orphan`, then apply it again: the usual way to re-create one without
    downtime. Its token Secret too is adopted as it is: a new token would restart every pod."""
    first_uid = (await cluster.apply_example())["metadata"]["uid"]
    await _all_owned(cluster)
    secret = cluster.get("v1/secrets", "smollm2-internal")
    templates = {n: d["spec"]["template"] for n, d in cluster.all(DEPLOYMENTS).items()}
    for resource in [*OWNED, "v1/secrets"]:  # what the garbage collector does for --cascade=orphan
        for name in cluster.all(resource):
            await cluster.patch(resource, name, {"metadata": {"ownerReferences": None}})
    await cluster.delete(CR, "smollm2")
    await cluster.wait_for("the LLMDeployment gone", lambda: cluster.get(CR, "smollm2") is None, 15)
    second_uid = (await cluster.apply_example())["metadata"]["uid"]
    assert second_uid != first_uid

    def owner_uids() -> set:
        return {(o["metadata"].get("ownerReferences") or [{}])[0].get("uid")
                for resource in [*OWNED, "v1/secrets"] for o in cluster.all(resource).values()}

    await cluster.wait_for("every object adopted", lambda: owner_uids() == {second_uid}, 15)
    adopted = cluster.get("v1/secrets", "smollm2-internal")
    assert adopted["metadata"]["uid"] == secret["metadata"]["uid"] and token_of(adopted) == token_of(secret)
    assert {n: d["spec"]["template"] for n, d in cluster.all(DEPLOYMENTS).items()} == templates
    # The new object's status is written after its objects are adopted: waited for, not assumed.
    await cluster.wait_for("the new object's status", lambda: "Degraded" in _conditions(cluster), 15)
    assert _conditions(cluster)["Degraded"]["reason"] != "ApplyFailed"


async def test_a_failed_change_reverted_before_a_retry_applied_it_still_ends_ready(cluster):
    """kopf sees no change in a spec reverted to what it last handled, so the spec handler never runs for it: the
    retry that applies it must say which generation runs, or Ready stayed False (SpecNotApplied) for good (found
    by a review helper)."""
    await cluster.apply_example()
    await cluster.wait_for("observedGeneration 1", lambda: (cluster.get(CR, "smollm2").get("status") or {}).get(
        "observedGeneration") == 1, 15)
    image = cluster.get(CR, "smollm2")["spec"]["image"]
    await cluster.delete(PDBS, "smollm2-router")
    await cluster.create(PDBS, foreign_disruption_budget("smollm2-router", "ns1"))
    await cluster.patch(CR, "smollm2", {"spec": {"image": "tandem/worker:9.9.9"}})  # generation 2: fails
    await cluster.wait_for("ApplyFailed", lambda: _conditions(cluster).get("Degraded", {}).get("reason") == "ApplyFailed")
    assert _conditions(cluster)["Ready"]["reason"] == "SpecNotApplied"
    await cluster.patch(CR, "smollm2", {"spec": {"image": image}})  # generation 3: generation 1's spec again
    await asyncio.sleep(1)
    await cluster.delete(PDBS, "smollm2-router")  # the retry (every 10 s) now goes through
    await cluster.wait_for("generation 3 observed", lambda: cluster.get(CR, "smollm2")["status"].get(
        "observedGeneration") == 3, 30)
    assert _conditions(cluster)["Ready"]["reason"] != "SpecNotApplied"


async def test_a_deleted_object_that_cannot_be_put_back_at_once_is_put_back_later(cluster):
    """The watch that puts back a deleted Deployment is no spec handler, which kopf would retry: its failed apply is
    retried by the operator's own timer, and said once (one Warning event while the problem stays the same)."""
    await cluster.apply_example()
    await _all_owned(cluster)
    await cluster.delete(PDBS, "smollm2-router")  # unwatched: back at the next reconcile
    await cluster.create(PDBS, foreign_disruption_budget("smollm2-router", "ns1"))
    await cluster.delete(DEPLOYMENTS, "smollm2-router")
    await cluster.wait_for("Degraded", lambda: _conditions(cluster).get("Degraded", {}).get("reason") == "ApplyFailed")
    await asyncio.sleep(12)  # a retry, 10 s on, meets the same problem
    assert cluster.get(DEPLOYMENTS, "smollm2-router") is None and len(cluster.events("ApplyFailed")) == 1

    await cluster.delete(PDBS, "smollm2-router")
    await cluster.wait_for("the router Deployment back", lambda: cluster.get(DEPLOYMENTS, "smollm2-router"), timeout=15)
    await _all_owned(cluster)
    await cluster.wait_for("Degraded cleared", lambda: _conditions(cluster)["Degraded"]["reason"] != "ApplyFailed")


async def test_a_deleted_deployment_is_recreated_each_time(cluster):
    await cluster.apply_example()
    await _all_owned(cluster)
    for attempt in range(3):
        await cluster.delete(DEPLOYMENTS, "smollm2-router")
        await cluster.wait_for(f"the router Deployment back ({attempt + 1})",
                               lambda: cluster.get(DEPLOYMENTS, "smollm2-router"))


async def test_tandem_operator_command_reconciles_and_exits_cleanly_on_sigterm(emulator, tmp_path):
    server = str(emulator.url).rstrip("/")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "nobody"}}]}))
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "operator", "--namespace", "ns1",
                                 "--kubeconfig", str(kubeconfig), "--resync-seconds", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"})
    cluster = Cluster(emulator, "ns1")
    try:
        await cluster.apply_example()
        await cluster.wait_for("the Deployments from the `tandem operator` process", lambda: len(
            cluster.all(DEPLOYMENTS)) == 3, timeout=30)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert f"tandem operator reconciling LLMDeployments in namespace ns1 via {server}" in output


def test_kopf_says_nothing_for_a_timer_run_that_went_through():
    """The planner's and the retry's timers run every few seconds per LLMDeployment, mostly finding nothing to do;
    a line for each would drown the log. Everything else kopf says stays."""
    import logging

    from tandem.operator.main import QuietTimers, quiet_timers

    def said(message: str) -> bool:
        return QuietTimers().filter(logging.LogRecord("kopf.objects", logging.INFO, __file__, 0, message, None, None))

    assert not said("Timer 'build_registry.<locals>.retry_failed_apply' succeeded.")
    assert said("Handler 'build_registry.<locals>.spec_changed' succeeded.")
    assert said("Timer 'build_registry.<locals>.plan' failed temporarily: boom")
    quiet_timers()
    quiet_timers()
    assert sum(isinstance(f, QuietTimers) for f in logging.getLogger("kopf.objects").filters) == 1


def test_replicas_started_alike_get_their_own_peering_priorities():
    """kopf pauses every replica that sees a peer of equal priority; the chart starts its replicas alike."""
    drawn = {peering_priority(None) for _ in range(50)}
    assert len(drawn) == 50 and min(drawn) >= 1
    assert peering_priority(7) == 7


def test_objects_are_created_by_server_side_apply():
    """Fields set by a create (an Update) belong to another owner entry than an Apply's, and a later apply
    removes only its own: created by POST, a field dropped from the spec would stay on the object for good."""
    calls = []

    class Recorder(Kube):
        def __init__(self):
            pass

        def request(self, method, path, body=None, query=None, content_type="application/json"):
            calls.append((method, content_type))
            if method == "GET":
                raise KubeError(404, method, path, "not found")
            return {"metadata": {"resourceVersion": "1"}}

    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns1"}, "data": {}}
    kube = Recorder()
    assert kube.carry_out(kube.plan(obj)) == "created"
    assert calls == [("GET", "application/json"), ("PATCH", "application/apply-patch+yaml")]


def test_what_belongs_to_an_llmdeployment():
    from tandem.operator.kube import owns

    spec, sizes = validate_spec(yaml.safe_load(EXAMPLE.read_text())["spec"], "smollm2")
    desired = build_objects(Owner("smollm2", "ns1", "uid-now"), spec, sizes)[0]
    meta = desired["metadata"]
    ours = {"metadata": {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]}}
    orphan = {"metadata": {"labels": meta["labels"]}}  # its owner reference removed (kubectl --cascade=orphan)
    previous = {"metadata": {"labels": meta["labels"], "ownerReferences": [
        {**meta["ownerReferences"][0], "uid": "uid-before"}]}}  # an earlier LLMDeployment of that name, going
    foreign = {"metadata": {"labels": {"app": "mine"}}}
    assert owns(desired, ours) and owns(desired, orphan)
    assert not owns(desired, previous) and not owns(desired, foreign)
