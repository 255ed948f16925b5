"""Pure builders: an LLMDeployment spec -> every Kubernetes object it owns, as plain dicts.

Nothing here talks to the API server, so each object can be asserted on and schema-validated directly.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.config import EngineConfig
from tandem.operator import devices, names
from tandem.operator.crd import DeploymentEngineSpec, LLMDeploymentSpec, LoraAdapter, PodSettings, PoolSpec
from tandem.operator.names import HTTP_PORT
from tandem.operator.sizing import PoolSizes
from tandem.server.internal_auth import INTERNAL_TOKEN_ENV

MODEL_MOUNT = "/models"
LORA_MOUNT = "/loras"  # hostPath adapters at /loras/<name>, adapter claims at /loras/pvc-<n>
CONFIG_MOUNT = "/etc/tandem/config"
TENANTS_MOUNT = "/etc/tandem/tenants"
RUN_AS = 10001  # the uid/gid the Dockerfiles create; any non-root id works with the emptyDir mounts below
# Endpoint removal reaches the routers' EndpointSlice watch while the pod sleeps in preStop; only then does
# SIGTERM arrive, and the server stops accepting and finishes the requests it has (see terminationGrace).
DRAIN_SECONDS = 10
ROUTER_GRACE_SECONDS = 60
# Engine settings that map one-to-one onto `tandem worker` options (the option is the EngineConfig field).
ENGINE_FLAG_FIELDS = ("dtype", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                      "kv_cache_memory_gb", "enable_prefix_caching", "quantization", "kv_cache_dtype",
                      "max_lora_rank", "max_loras", "tool_call_parser")
# Writable places for a read-only root filesystem: Python, Triton and HF caches all go under /tmp.
INTERNAL_TOKEN_KEY = "token"  # the key of the token in names.internal_secret_name's Secret
WRITABLE_ENV = [{"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
                {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"}, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}]


@dataclass(frozen=True)
class Owner:
    """The LLMDeployment the objects belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict:
        return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: Owner, name: str, component: str, annotations: dict | None = None) -> dict:
    meta = {"name": name, "namespace": owner.namespace, "labels": names.labels(owner.name, component),
            "ownerReferences": [owner.reference()]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def short_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# -- model, engine and pod pieces ------------------------------------------------------------------------


def model_location(spec: LLMDeploymentSpec) -> tuple[str, list[dict], list[dict]]:
    """(the worker's --model argument, volumes, volume mounts) for the model source."""
    source, fmt = spec.model.source, spec.model.format
    if source.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        return posixpath.join(MODEL_MOUNT, source.pvc.path), [volume], [mount]
    if source.host_path is not None:
        host = source.host_path.path.rstrip("/")
        target = posixpath.join(MODEL_MOUNT, posixpath.basename(host))
        volume = {"name": "model", "hostPath": {"path": host, "type": "File" if fmt == "gguf" else "Directory"}}
        return target, [volume], [{"name": "model", "mountPath": target, "readOnly": True}]
    return source.uri, [], []


def engine_args(engine: DeploymentEngineSpec, tensor_parallel_size: int = 1) -> list[str]:
    """Only the settings the spec sets: everything else keeps the worker's own defaults. `tensor_parallel_size` is
    the pool's (devices.pool_tp)."""
    args: list[str] = []
    for field in ENGINE_FLAG_FIELDS:
        value = getattr(engine, field)
        if value is None:
            continue
        flag = field.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", str(value)]
    if engine.speculative_config is not None:
        args += ["--speculative-config", engine.speculative_config.as_json()]
    if tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return args


def _adapter_claims(spec: LLMDeploymentSpec) -> dict[str, str]:
    """The volume of each claim the adapters read from: the model's own when it is the same claim, else one each."""
    model_claim = spec.model.source.pvc.claim_name if spec.model.source.pvc is not None else None
    claims = {model_claim: "model"} if model_claim else {}
    for adapter in spec.lora_adapters or []:
        pvc = adapter.source.pvc
        if pvc is not None and pvc.claim_name not in claims:
            claims[pvc.claim_name] = f"lora-pvc-{sum(v != 'model' for v in claims.values())}"
    return claims


def _claim_mount(volume: str) -> str:
    return MODEL_MOUNT if volume == "model" else posixpath.join(LORA_MOUNT, volume.removeprefix("lora-"))


def _adapter_path(adapter: LoraAdapter, index: int, claims: dict[str, str]) -> str:
    if adapter.source.pvc is not None:
        return posixpath.join(_claim_mount(claims[adapter.source.pvc.claim_name]), adapter.source.pvc.path)
    return posixpath.join(LORA_MOUNT, f"host-{index}")


def lora_location(spec: LLMDeploymentSpec) -> tuple[list[str], list[dict], list[dict]]:
    """(the workers' LoRA options, volumes, volume mounts) for spec.loraAdapters; nothing when there are none."""
    adapters = spec.lora_adapters or []
    if not adapters:
        return [], [], []
    claims = _adapter_claims(spec)
    volumes, mounts = [], []
    for claim, volume in claims.items():
        if volume != "model":  # the model's volume is mounted already (model_location)
            volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
            mounts.append({"name": volume, "mountPath": _claim_mount(volume), "readOnly": True})
    modules = []
    for index, adapter in enumerate(adapters):
        path = _adapter_path(adapter, index, claims)
        if adapter.source.host_path is not None:
            volume = f"lora-host-{index}"
            volumes.append({"name": volume, "hostPath": {"path": adapter.source.host_path.path.rstrip("/") or "/",
                                                         "type": "Directory"}})
            mounts.append({"name": volume, "mountPath": path, "readOnly": True})
        modules.append(f"{adapter.name}={path}")
    return ["--enable-lora", "--lora-modules", *modules], volumes, mounts


def pod_env(settings: PodSettings) -> list[dict]:
    """The spec's env entries as a container's env."""
    return [e.model_dump(by_alias=True, exclude_none=True) for e in settings.env or []]


def internal_token_env(owner: Owner) -> dict:
    """The router's and the workers' shared secret on the workers' internal endpoints, from the Secret the
    operator creates once per deployment (reconcile.create_internal_secret)."""
    return {"name": INTERNAL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": names.internal_secret_name(owner.name), "key": INTERNAL_TOKEN_KEY}}}


def _resources(settings: PodSettings) -> dict:
    return settings.resources.model_dump(by_alias=True, exclude_none=True) if settings.resources else {}


def _probes() -> dict:
    http = {"port": "http"}
    return {
        "readinessProbe": {"httpGet": {"path": "/ready", **http}, "periodSeconds": 5, "timeoutSeconds": 2,
                           "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", **http}, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 3},
        # Loading a large model takes minutes; liveness only starts counting once /health answers.
        "startupProbe": {"httpGet": {"path": "/health", **http}, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": 90},
    }


def _container(name: str, image: str, args: list[str], env: list[dict], resources: dict,
               mounts: list[dict], pull_policy: str | None, pre_stop: list[str] | None = None) -> dict:
    container = {
        "name": name,
        "image": image,
        "command": ["tandem"],
        "args": args,
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": [*WRITABLE_ENV, *env],
        "resources": resources,
        **_probes(),
        "lifecycle": {"preStop": {"exec": {"command": pre_stop or ["sleep", str(DRAIN_SECONDS)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    return container


def _pod_spec(owner: Owner, component: str, container: dict, settings: PodSettings, volumes: list[dict],
              grace_seconds: int, service_account: str | None, pull_secrets: list[str] | None) -> dict:
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}}, *volumes],
        "terminationGracePeriodSeconds": grace_seconds,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    else:  # workers never call the API server: no token in the pod
        spec["automountServiceAccountToken"] = False
    if pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = list(settings.tolerations)
    if settings.priority_class_name:
        spec["priorityClassName"] = settings.priority_class_name
    if settings.runtime_class_name:
        spec["runtimeClassName"] = settings.runtime_class_name
    # Spread replicas over nodes unless the user placed them explicitly: one node failure, one worker lost.
    spec["affinity"] = settings.affinity or {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": names.selector_labels(owner.name, component)}}}]}}
    return spec


_SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                       "prometheus.io/path": "/metrics"}


def _deployment(owner: Owner, component: str, replicas: int, pod_spec: dict, strategy: dict,
                settings: PodSettings, operator_annotations: dict) -> dict:
    # The user's labels and annotations first, the operator's over them (the spec refuses overlaps anyway), but
    # after the scrape annotations: `prometheus.io/scrape: "false"` turns scraping off.
    labels = {**(settings.pod_labels or {}), **names.labels(owner.name, component)}
    annotations = {**_SCRAPE_ANNOTATIONS, **(settings.pod_annotations or {}), **operator_annotations}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, names.object_name(owner.name, component), component,
                              {names.REPLICAS_ANNOTATION: str(replicas)}),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": names.selector_labels(owner.name, component)},
            "strategy": strategy,
            "template": {"metadata": {"labels": labels, "annotations": annotations},
                         "spec": pod_spec},
        },
    }


def kept_replicas(current: Mapping[str, Any] | None, asked: int) -> int:
    """The replicas a Deployment should have when the operator asks for `asked`: its own replicas while the operator
    asked it for `asked` already (names.REPLICAS_ANNOTATION), so that an autoscaler's or a person's change holds
    until the operator asks for another number; `asked` otherwise."""
    if current is None:
        return asked
    annotations = current.get("metadata", {}).get("annotations") or {}
    replicas = current.get("spec", {}).get("replicas")
    if annotations.get(names.REPLICAS_ANNOTATION) == str(asked) and isinstance(replicas, int):
        return replicas
    return asked


# -- the owned objects -----------------------------------------------------------------------------------


def worker_deployment(owner: Owner, spec: LLMDeploymentSpec, pool: str, replicas: int,
                      internal_secret: str | None = None) -> dict:
    settings: PoolSpec = getattr(spec, pool)
    tp = devices.pool_tp(spec, pool)
    model_arg, volumes, mounts = model_location(spec)
    lora_args, lora_volumes, lora_mounts = lora_location(spec)
    volumes, mounts = [*volumes, *lora_volumes], [*mounts, *lora_mounts]
    args = ["worker", "--role", pool, "--model", model_arg, "--served-model-name", spec.model.name,
            "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--kv-transfer", spec.kv_transfer.backend,
            "--kv-transfer-lanes", str(spec.kv_transfer.lanes), *engine_args(spec.engine, tp), *lora_args,
            *(settings.extra_args or [])]
    env = [internal_token_env(owner), *pod_env(settings), *devices.nccl_env(spec, pool)]
    if spec.kv_transfer.ucx_transports:
        env.append({"name": "UCX_TLS", "value": ",".join(spec.kv_transfer.ucx_transports)})
    # UCX's shared-memory transport, torch's IPC and NCCL need a real /dev/shm, not the runtime's 64 MiB default.
    volumes = [*volumes, {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": devices.shm_size(tp)}}]
    mounts = [*mounts, {"name": "shm", "mountPath": "/dev/shm"}]
    # Scale-down drain: the worker leaves every router's rotation (its /ready turns 503) and finishes
    # what it has before SIGTERM. The preStop hook's time counts in the grace period: a few seconds of it are kept
    # for the server's own exit (its shutdown gives the requests left 5 s).
    drain = ["tandem", "drain", "--url", f"http://127.0.0.1:{HTTP_PORT}",
             "--timeout", str(max(settings.termination_grace_period_seconds - 5, 0))]
    resources = devices.with_gpus(_resources(settings), spec, pool)
    container = _container("worker", spec.image, args, env, resources, mounts, spec.image_pull_policy, drain)
    pod = _pod_spec(owner, pool, container, settings, volumes, settings.termination_grace_period_seconds, None,
                    spec.image_pull_secrets)
    # GPUs are rarely spare: replace workers one at a time instead of surging an extra one.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return _deployment(owner, pool, replicas, pod, strategy, settings, _with_secret({}, internal_secret))


ROUTER_READS = "slo-classes.json"  # the ConfigMap's file the router reads ($TANDEM_CONFIG_DIR)


def router_config(spec: LLMDeploymentSpec, sizes: PoolSizes) -> dict[str, str]:
    """The ConfigMap's files: what the router reads beside its command-line options, and the deployment's shape
    for people and tools (deployment.json)."""
    deployment = {"model": spec.model.name, "pools": {"prefill": sizes.prefill, "decode": sizes.decode},
                  "tensorParallelSize": {pool: devices.pool_tp(spec, pool) for pool in names.POOLS},
                  "ratio": sizes.ratio, "kvTransfer": spec.kv_transfer.model_dump(by_alias=True, exclude_none=True),
                  "blockSize": spec.engine.block_size or EngineConfig.model_fields["block_size"].default}
    return {ROUTER_READS: _slo_classes_file(spec),
            "deployment.json": json.dumps(deployment, indent=2, sort_keys=True) + "\n"}


def _slo_classes_file(spec: LLMDeploymentSpec) -> str:
    slo_classes = [c.model_dump(by_alias=True) for c in spec.router.slo_classes or []]
    return json.dumps(slo_classes, indent=2, sort_keys=True) + "\n"


MULTI_ROUTER_KEY_EPS = 0.25


def _with_secret(annotations: dict, internal_secret: str | None) -> dict:
    """Pod annotations naming the internal-token Secret's uid: a Secret made again (deleted, then recreated by
    reconcile.create_internal_secret with a new token) rolls the router and both pools, which read the token only
    when their pods start; without it, old and new pods would hold different tokens for good."""
    if internal_secret:
        annotations[names.INTERNAL_SECRET_ANNOTATION] = internal_secret
    return annotations


def router_deployment(owner: Owner, spec: LLMDeploymentSpec, internal_secret: str | None = None) -> dict:
    router = spec.router
    model_arg, volumes, mounts = model_location(spec)  # the router tokenizes prompts with the model's tokenizer
    # The name clients send, and the seed of the prefix hashes: the workers' own (worker_deployment).
    args = ["router", "--model", model_arg, "--served-model-name", spec.model.name,
            "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--discovery", "kubernetes", "--namespace", owner.namespace,
            "--prefill-selector", names.pool_selector(owner.name, "prefill"),
            "--decode-selector", names.pool_selector(owner.name, "decode")]
    # SIGTERM comes after the preStop sleep; requests then get what is left of the grace period, less a margin
    # to end those still running with an error (not a SIGKILL's cut connection).
    args += ["--graceful-shutdown-s", str(ROUTER_GRACE_SECONDS - DRAIN_SECONDS - 5)]
    if router.disagg_min_tokens is not None:
        args += ["--disagg-min-tokens", str(router.disagg_min_tokens)]
    if router.decode_overload_min_seqs is not None:
        args += ["--decode-overload-min-seqs", str(router.decode_overload_min_seqs)]
    if spec.engine.block_size is not None:  # the router hashes prompts in the workers' blocks
        args += ["--block-size", str(spec.engine.block_size)]
    if spec.engine.tool_call_parser is not None:  # the router forms the answers: it reads their tool calls
        args += ["--tool-call-parser", spec.engine.tool_call_parser]
    # Balance on keys is tightest at eps 0, but independent replicas then agree on only about half of the keys
    # whose ring owner is full (router/policies/key_table.py); with several replicas, trade a little balance.
    key_eps = router.key_eps if router.key_eps is not None else (0.0 if router.replicas == 1 else MULTI_ROUTER_KEY_EPS)
    if key_eps:
        args += ["--key-eps", str(key_eps)]
    prefill_tps = spec.scaling.prefill.tokens_per_second
    if prefill_tps is not None:
        # One prefill replica's capacity: what admission predicts waits with until this router has measured its own,
        # so that a router started into traffic (a rolling update, a scale-up) does not admit blind meanwhile.
        args += ["--initial-prefill-tps", str(prefill_tps)]
    env = [internal_token_env(owner), *pod_env(router), {"name": "TANDEM_CONFIG_DIR", "value": CONFIG_MOUNT}]
    volumes = [*volumes, {"name": "config", "configMap": {"name": names.config_map_name(owner.name)}}]
    mounts = [*mounts, {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    if router.tenants_secret:
        env.append({"name": "TANDEM_TENANTS_DIR", "value": TENANTS_MOUNT})
        volumes.append({"name": "tenants", "secret": {"secretName": router.tenants_secret}})
        mounts.append({"name": "tenants", "mountPath": TENANTS_MOUNT, "readOnly": True})
    image = router.image or spec.image
    container = _container("router", image, args, env, _resources(router), mounts, spec.image_pull_policy)
    pod = _pod_spec(owner, "router", container, router, volumes, ROUTER_GRACE_SECONDS,
                    names.object_name(owner.name, "router"), spec.image_pull_secrets)
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    # Changed SLO classes must restart the routers: their hash is part of the pod template. Only the file the
    # router reads: pool sizes change with every scaling decision, and must not roll the routers each time.
    annotations = {names.CONFIG_HASH_ANNOTATION: short_hash({ROUTER_READS: _slo_classes_file(spec)})}
    return _deployment(owner, "router", router.replicas, pod, strategy, router, _with_secret(annotations, internal_secret))


def _port(port: int) -> dict:
    return {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}


def pool_service(owner: Owner, pool: str) -> dict:
    """Headless: the router wants each worker's address (EndpointSlices), not a load-balanced VIP."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, names.object_name(owner.name, pool), pool),
            "spec": {"clusterIP": "None", "selector": names.selector_labels(owner.name, pool),
                     "ports": [_port(HTTP_PORT)], "publishNotReadyAddresses": False}}


def router_service(owner: Owner, spec: LLMDeploymentSpec) -> dict:
    router = spec.router
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": _metadata(owner, names.object_name(owner.name, "router"), "router",
                                     dict(router.service_annotations or {})),
               "spec": {"type": router.service_type, "selector": names.selector_labels(owner.name, "router"),
                        "ports": [_port(router.port)]}}
    if router.load_balancer_source_ranges:
        service["spec"]["loadBalancerSourceRanges"] = list(router.load_balancer_source_ranges)
    return service


def config_map(owner: Owner, spec: LLMDeploymentSpec, sizes: PoolSizes) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(owner, names.config_map_name(owner.name), "router"),
            "data": router_config(spec, sizes)}


def router_rbac(owner: Owner) -> list[dict]:
    """The router's identity and the one permission it needs: reading its pools' EndpointSlices."""
    account = names.object_name(owner.name, "router")
    role = names.discovery_role_name(owner.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, account, "router"),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(owner, role, "router"),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _metadata(owner, role, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": owner.namespace}]},
    ]


def disruption_budget(owner: Owner, component: str) -> dict:
    """Voluntary evictions (node drains, upgrades) take at most one pod of a pool at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, names.object_name(owner.name, component), component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(owner.name, component)}}}


def build_objects(owner: Owner, spec: LLMDeploymentSpec, sizes: PoolSizes, internal_secret: str | None = None
                  ) -> list[dict]:
    """Every object the LLMDeployment owns, in the order they should be applied (dependencies first).
    `internal_secret`: the uid of the internal-token Secret, which the pods' templates carry (_with_secret)."""
    return [
        *router_rbac(owner),
        config_map(owner, spec, sizes),
        pool_service(owner, "prefill"),
        pool_service(owner, "decode"),
        router_service(owner, spec),
        worker_deployment(owner, spec, "prefill", sizes.prefill, internal_secret),
        worker_deployment(owner, spec, "decode", sizes.decode, internal_secret),
        router_deployment(owner, spec, internal_secret),
        *(disruption_budget(owner, component) for component in names.COMPONENTS),
    ]
