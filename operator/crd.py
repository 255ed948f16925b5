"""The LLMDeployment custom resource as pydantic models: what the operator enforces, and what
`python -m tandem.operator.crdgen` generates crds/llmdeployment.yaml from.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from tandem.config import EngineConfig, SpeculativeConfig
from tandem.openai.tool_parsers import ToolCallParserName

# -- LLMDeployment: the operator's custom resource -------------------------------------------------------
# `crds/llmdeployment.yaml` is generated from the models below (`python -m tandem.operator.crdgen`); a test fails when
# the committed file drifts. Each cross-field rule lives twice on purpose: as a pydantic validator (what the
# operator enforces, and what kmock-based tests exercise) and as a CEL rule with the same message (what the
# API server enforces at `kubectl apply` time). A test checks that both give the same verdicts.

CRD_GROUP = "serving.tandem.dev"
CRD_VERSION = "v1alpha1"
CRD_KIND = "LLMDeployment"
CRD_PLURAL = "llmdeployments"
CRD_SINGULAR = "llmdeployment"
CRD_SHORT_NAMES = ("llmdep",)

def _cel(rule: str, message: str) -> dict:
    return {"rule": rule, "message": message}


RATIO_PATTERN = r"^[1-9][0-9]{0,3}:[1-9][0-9]{0,3}$"
# Kubernetes resource.Quantity, as the API server's own OpenAPI schema spells it.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"  # a model name clients send; no '=' (an adapter's NAME=PATH)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# The pod labels the operator's selectors match, and its own key domain (roll-triggering hashes): a user's
# podLabels or podAnnotations must leave them to the operator, or a Deployment would lose its pods.
OPERATOR_LABEL_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                       "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by")
# Checked by the operator's model only, not by a CEL rule of the CRD: the API server costs a rule that iterates a
# map by the largest map the request could hold, and a pod's labels have no bound that would keep that cost low.
RESERVED_LABELS_MESSAGE = (f"podLabels: the operator sets {', '.join(OPERATOR_LABEL_KEYS)} and the {CRD_GROUP}/ "
                           "keys")
RESERVED_ANNOTATIONS_MESSAGE = f"podAnnotations: the operator sets the {CRD_GROUP}/ keys"


def _with_defaults_from_engine(field: str, what: str) -> str:
    return f"{what} (default: the worker's, {EngineConfig.model_fields[field].default})"


class _CamelModel(BaseModel):
    """Kubernetes spells fields in camelCase; Python code uses the snake_case attribute names."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PVCModelSource(_CamelModel):
    claim_name: str = Field(..., min_length=1, max_length=253,
                            description="PersistentVolumeClaim in the same namespace (mounted read-only; "
                                        "ReadOnlyMany or ReadWriteMany for more than one pod)")
    path: str = Field(..., min_length=1, pattern=r"^[^/]",
                      description="the model inside the claim, relative: a .gguf file or a HF checkpoint folder")


class HostPathModelSource(_CamelModel):
    path: str = Field(..., pattern=r"^/.", description="absolute path on every node: a .gguf file or a HF "
                                                        "checkpoint folder (mounted read-only)")


_ONE_SOURCE_RULE = _cel("[has(self.pvc), has(self.hostPath), has(self.uri)].filter(x, x).size() == 1",
                        "model.source needs exactly one of pvc, hostPath or uri")


class ModelSource(_CamelModel):
    """Where the worker reads the model from: exactly one of the three."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_ONE_SOURCE_RULE]})

    pvc: PVCModelSource | None = None
    host_path: HostPathModelSource | None = None
    uri: str | None = Field(None, min_length=1, description="given to the worker's --model as is: 'smollm2' "
                                                           "(bundled) or a path that exists inside the image")

    @model_validator(mode="after")
    def _exactly_one(self):
        if sum(x is not None for x in (self.pvc, self.host_path, self.uri)) != 1:
            raise ValueError(_ONE_SOURCE_RULE["message"])
        return self


_GGUF_SUFFIX_RULE = _cel(
    "!has(self.source.pvc) || (self.format == 'gguf') == self.source.pvc.path.endsWith('.gguf')",
    "model.format must match the file: a 'gguf' model is a .gguf file, an 'hf' model is a folder")
_GGUF_SUFFIX_HOST_RULE = _cel(
    "!has(self.source.hostPath) || (self.format == 'gguf') == self.source.hostPath.path.endsWith('.gguf')",
    _GGUF_SUFFIX_RULE["message"])


class ModelSpec(_CamelModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_GGUF_SUFFIX_RULE,
                                                                              _GGUF_SUFFIX_HOST_RULE]})

    name: str = Field(..., min_length=1, max_length=128, pattern=SERVED_NAME_PATTERN,
                      description="the model name clients send in requests (the served model name)")
    format: Literal["gguf", "hf"] = Field(..., description="'gguf': one .gguf file; 'hf': a folder with "
                                                            "config.json, *.safetensors and a tokenizer")
    source: ModelSource

    def path_in_source(self) -> str | None:
        if self.source.pvc is not None:
            return self.source.pvc.path
        if self.source.host_path is not None:
            return self.source.host_path.path
        return None

    @model_validator(mode="after")
    def _format_matches_file(self):
        path = self.path_in_source()
        if path is not None and (self.format == "gguf") != path.endswith(".gguf"):  # exactly as the CEL rule
            raise ValueError(_GGUF_SUFFIX_RULE["message"])
        return self


MAX_TENSOR_PARALLEL = 16  # GPUs one worker may span: one node's

_LOOKUP_WINDOW_RULE = _cel("!has(self.promptLookupMin) || !has(self.promptLookupMax) "
                           "|| self.promptLookupMin <= self.promptLookupMax",
                           "engine.speculativeConfig: promptLookupMin must not exceed promptLookupMax")


class SpeculativeSpec(_CamelModel):
    """N-gram speculative decoding: the workers' --speculative-config (docs/speculative-decoding.md)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_LOOKUP_WINDOW_RULE]})

    method: Literal["ngram"] = Field("ngram", description="how draft tokens are proposed: ngram (prompt lookup)")
    num_speculative_tokens: int = Field(..., ge=1, le=32, description="draft tokens proposed per step")
    prompt_lookup_max: int | None = Field(None, ge=1, description="longest n-gram matched (default: "
                                                                  "promptLookupMin, else 5)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="shortest n-gram matched (default: "
                                                                  "promptLookupMax)")

    def as_json(self) -> str:
        """vLLM's JSON text, as the worker's --speculative-config reads it."""
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))

    @model_validator(mode="after")
    def _engine_accepts_it(self):
        if None not in (self.prompt_lookup_min, self.prompt_lookup_max) and \
                self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(_LOOKUP_WINDOW_RULE["message"])
        SpeculativeConfig.parse(self.as_json())  # whatever else the worker would refuse
        return self


class DeploymentEngineSpec(_CamelModel):
    """Engine settings shared by every worker; unset fields keep the worker's defaults (tandem/config.py)."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        None, description=_with_defaults_from_engine("dtype", "weights and activations dtype"))
    max_model_len: int | None = Field(None, ge=1, description="context length; default: the model's")
    block_size: int | None = Field(None, ge=1, le=1024, description=_with_defaults_from_engine(
        "block_size", "tokens per KV block (the router hashes prefixes with the same size)"))
    max_num_seqs: int | None = Field(None, ge=1, description=_with_defaults_from_engine(
        "max_num_seqs", "sequences per batch"))
    max_num_batched_tokens: int | None = Field(None, ge=1, description=_with_defaults_from_engine(
        "max_num_batched_tokens", "per-step token budget"))
    kv_cache_memory_gb: float | None = Field(None, gt=0, description=_with_defaults_from_engine(
        "kv_cache_memory_gb", "KV cache size in GiB per worker"))
    enable_prefix_caching: bool | None = Field(None, description=_with_defaults_from_engine(
        "enable_prefix_caching", "reuse cached KV blocks of shared prefixes"))
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_TENSOR_PARALLEL, strict=True,
                                      description="ranks per worker (one GPU each on GPUs); the pools' "
                                                  "tensorParallelSize overrides it")
    quantization: Literal["fp8"] | None = Field(
        None, description="fp8: the GEMM weights quantized to FP8 at load (the workers' --quantization; default: "
                          "none, the checkpoint's dtype)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] | None = Field(
        None, description=_with_defaults_from_engine("kv_cache_dtype", "KV cache storage; fp8 halves it against "
                                                     "16-bit (the workers' --kv-cache-dtype)"))
    speculative_config: SpeculativeSpec | None = Field(None, description="speculative decoding (the workers' "
                                                                         "--speculative-config); default: off")
    max_lora_rank: int | None = Field(None, ge=1, le=512, description=_with_defaults_from_engine(
        "max_lora_rank", "the largest rank of spec.loraAdapters"))
    max_loras: int | None = Field(None, ge=1, le=256, description=_with_defaults_from_engine(
        "max_loras", "LoRA adapters resident on the device at once"))
    tool_call_parser: ToolCallParserName | None = Field(
        None, description='serve tool_choice "auto" with this parser of the model\'s tool calls (the workers\' and '
                          "routers' --tool-call-parser); hermes: <tool_call>{...}</tool_call> blocks. Unset: "
                          '"auto" is refused')


class EnvVar(_CamelModel):
    name: str = Field(..., min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="as in a Pod's env[].valueFrom")


class ResourceRequirements(_CamelModel):
    limits: dict[str, int | str] | None = Field(None, description="e.g. {cpu: 8, memory: 64Gi, nvidia.com/gpu: 1}")
    requests: dict[str, int | str] | None = None

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, value):
        for key, quantity in (value or {}).items():
            if isinstance(quantity, str) and not re.fullmatch(QUANTITY_PATTERN, quantity):
                raise ValueError(f"{key}: {quantity!r} is not a Kubernetes quantity (e.g. 500m, 16Gi, 1)")
        return value


class PodSettings(_CamelModel):
    """Scheduling and container settings shared by the pools and the router."""

    resources: ResourceRequirements | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = Field(None, description="as in a Pod's spec.tolerations")
    affinity: dict[str, Any] | None = Field(None, description="as in a Pod's spec.affinity")
    env: list[EnvVar] | None = None
    pod_labels: dict[str, str] | None = Field(None, description="more labels of the pods, e.g. a team or cost "
                                              "centre (not the operator's app.kubernetes.io/ selector labels)")
    pod_annotations: dict[str, str] | None = Field(None, description="more annotations of the pods, e.g. a "
                                                   "service mesh's; applied after the prometheus.io/ scrape ones")
    priority_class_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                                            description="as in a Pod's spec.priorityClassName")
    runtime_class_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                                           description="as in a Pod's spec.runtimeClassName, e.g. nvidia")

    @field_validator("pod_labels")
    @classmethod
    def _not_the_operators_labels(cls, value):
        if any(k.startswith(f"{CRD_GROUP}/") or k in OPERATOR_LABEL_KEYS for k in value or {}):
            raise ValueError(RESERVED_LABELS_MESSAGE)
        return value

    @field_validator("pod_annotations")
    @classmethod
    def _not_the_operators_annotations(cls, value):
        if any(k.startswith(f"{CRD_GROUP}/") for k in value or {}):
            raise ValueError(RESERVED_ANNOTATIONS_MESSAGE)
        return value


class PoolSpec(PodSettings):
    replicas: int | None = Field(None, ge=0, le=10000, description="workers in this pool; leave unset when "
                                                                    "spec.ratio and spec.replicas size the pools")
    tensor_parallel_size: int | None = Field(None, ge=1, le=MAX_TENSOR_PARALLEL, strict=True,
                                             description="ranks per worker of this pool, one GPU each on GPUs "
                                                         "(default: spec.engine.tensorParallelSize)")
    extra_args: list[str] | None = Field(None, description="more `tandem worker` options for this pool")
    termination_grace_period_seconds: int = Field(120, ge=0, le=3600, description="time a stopping worker "
                                                                                 "gets to finish its requests")


MAX_LORA_ADAPTERS = 64


class PVCAdapterSource(_CamelModel):
    claim_name: str = Field(..., min_length=1, max_length=253,
                            description="PersistentVolumeClaim in the same namespace (mounted read-only; "
                                        "ReadOnlyMany or ReadWriteMany for more than one pod)")
    path: str = Field(..., min_length=1, pattern=r"^[^/]",
                      description="the adapter's PEFT folder inside the claim, relative")


class HostPathAdapterSource(_CamelModel):
    path: str = Field(..., pattern=r"^/.", description="absolute path of the adapter's PEFT folder on every node "
                                                        "(mounted read-only)")


_ONE_ADAPTER_SOURCE_RULE = _cel("[has(self.pvc), has(self.hostPath)].filter(x, x).size() == 1",
                                "loraAdapters[].source needs exactly one of pvc or hostPath")


class AdapterSource(_CamelModel):
    """Where a LoRA adapter's folder is: exactly one of the two."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_ONE_ADAPTER_SOURCE_RULE]})

    pvc: PVCAdapterSource | None = None
    host_path: HostPathAdapterSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if sum(x is not None for x in (self.pvc, self.host_path)) != 1:
            raise ValueError(_ONE_ADAPTER_SOURCE_RULE["message"])
        return self


class LoraAdapter(_CamelModel):
    """A PEFT LoRA adapter every worker loads at start, served under its own model name (docs/lora.md)."""

    name: str = Field(..., min_length=1, max_length=128, pattern=SERVED_NAME_PATTERN,
                      description="the model name clients send to use the adapter")
    source: AdapterSource


class SLOClass(_CamelModel):
    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    ttft_ms: float = Field(..., gt=0, description="time-to-first-token target in milliseconds")
    itl_ms: float = Field(..., gt=0, description="inter-token latency target in milliseconds")


class RouterSpec(PodSettings):
    replicas: int = Field(1, ge=1, le=1000)
    image: str | None = Field(None, min_length=1, description="default: spec.image")
    service_type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = "ClusterIP"
    service_annotations: dict[str, str] | None = Field(None, description="annotations of the router Service, e.g. "
                                                       "a cloud's internal load balancer")
    load_balancer_source_ranges: list[str] | None = Field(None, description="with serviceType LoadBalancer: the "
                                                          "client CIDRs it admits (default: any)")
    port: int = Field(8000, ge=1, le=65535, description="port of the router Service")
    disagg_min_tokens: int | None = Field(None, ge=0, description="prompts shorter than this skip the prefill "
                                                                  "pool (default: the router's)")
    decode_overload_min_seqs: int | None = Field(None, ge=1, description="a decode worker holding fewer sequences "
                                                 "keeps every colocated request of its prefix key (router "
                                                 "--decode-overload-min-seqs; default: an eighth of the worker's "
                                                 "max_num_seqs, 8 for the default 64)")
    key_eps: float | None = Field(None, ge=0, description="bounded loads on prefix keys (router --key-eps); "
                                  "default 0 with one replica, 0.25 with more, so that replicas agree on more keys")
    slo_classes: list[SLOClass] | None = Field(None, description="admission classes with latency targets")
    tenants_secret: str | None = Field(None, min_length=1, max_length=253,
                                       description="Secret with the tenants (API keys, token buckets), "
                                                   "mounted read-only at /etc/tandem/tenants")

    @field_validator("load_balancer_source_ranges")
    @classmethod
    def _cidrs(cls, value):
        for cidr in value or []:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
        return value


class KVTransferSpec(_CamelModel):
    backend: Literal["nixl", "tcp"] = Field("nixl", description="how decode workers pull KV blocks")
    ucx_transports: list[str] | None = Field(None, description="UCX_TLS for NIXL, e.g. [rc, cuda_copy, "
                                                                "cuda_ipc]; default: UCX picks")
    lanes: int = Field(2, ge=1, le=64, description="NIXL: reading agents a KV pull is split over, each copying "
                                                   "in its own thread (the workers' --kv-transfer-lanes)")


_POOL_LIMITS_RULE = _cel("self.min <= self.max", "scaling: a pool's min must not exceed its max")


class PoolScalingLimits(_CamelModel):
    """How far the planner may move one pool."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_POOL_LIMITS_RULE]})

    min: int = Field(1, ge=0, le=10000, description="fewest replicas the planner leaves in the pool")
    max: int = Field(100, ge=1, le=10000, description="most replicas the planner gives the pool")
    tokens_per_second: float | None = Field(
        None, gt=0, description="one replica's capacity in tokens/s (prompt tokens for prefill, generated "
                                "tokens for decode), e.g. from `tandem plan`; the measured throughput per "
                                "replica replaces it when higher. Needed by the metrics the operator scrapes")

    @model_validator(mode="after")
    def _min_not_above_max(self):
        if self.min > self.max:
            raise ValueError(f"{_POOL_LIMITS_RULE['message']} ({self.min} > {self.max})")
        return self


class ScalingSpec(_CamelModel):
    """Who sets the pool sizes: the spec (manual) or the planner, from the routers' and workers' metrics."""

    mode: Literal["manual", "planner"] = Field("manual", description="'planner': spec.ratio/replicas (or the "
                                                                    "pools' replicas) are the starting point "
                                                                    "and the planner owns replicas afterwards")
    prefill: PoolScalingLimits = Field(default_factory=PoolScalingLimits)
    decode: PoolScalingLimits = Field(default_factory=PoolScalingLimits)
    gpu_budget: int | None = Field(None, ge=1, le=1000000, description="most GPUs both pools may use together")
    interval_seconds: float = Field(30.0, gt=0, le=3600, description="how often the planner decides")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="a pool moves only when its need leaves "
                                                          "current x (1 +/- hysteresis)")
    cooldown_seconds: float = Field(60.0, ge=0, le=86400, description="no scale-up this soon after a change")
    scale_down_cooldown_seconds: float | None = Field(None, ge=0, le=86400, description="no scale-down this "
                                                                                        "soon after a change "
                                                                                        "(default: cooldownSeconds)")
    target_utilization: float = Field(0.8, gt=0, le=1, description="busy fraction the planner sizes each pool for")


_SIZING_RULES = [
    _cel("!has(self.ratio) || has(self.replicas)",
         "spec.ratio needs spec.replicas: the total number of workers to split in that ratio"),
    _cel("!has(self.replicas) || has(self.ratio)",
         "spec.replicas is the total to split by spec.ratio: set spec.ratio too, or size the pools "
         "with prefill.replicas and decode.replicas instead"),
    _cel("!has(self.ratio) || !((has(self.prefill) && has(self.prefill.replicas)) "
         "|| (has(self.decode) && has(self.decode.replicas)))",
         "spec.ratio sizes the pools: do not also set prefill.replicas or decode.replicas"),
    _cel("has(self.ratio) || (has(self.prefill) && has(self.prefill.replicas) "
         "&& has(self.decode) && has(self.decode.replicas))",
         "size the pools: set spec.ratio with spec.replicas, or both prefill.replicas and decode.replicas"),
]

# PoolSpec allows 0 replicas, which a prefill pool may have (every prompt then prefills on its decode worker);
# a decode pool may not: decode workers generate every response. (operator/validation.py says so too.)
_ADAPTER_NOT_THE_MODEL = _cel("!has(self.loraAdapters) || self.loraAdapters.all(a, a.name != self.model.name)",
                              "loraAdapters: an adapter's name must differ from model.name (the base model's)")
_AT_LEAST_ONE_DECODE = _cel("!has(self.decode) || !has(self.decode.replicas) || self.decode.replicas >= 1",
                            "spec.decode.replicas: must be at least 1: decode workers generate every response")


class LLMDeploymentSpec(_CamelModel):
    """What `kubectl apply` asks for: a model served by a prefill pool, a decode pool and a router."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [*_SIZING_RULES, _AT_LEAST_ONE_DECODE,
                                                                             _ADAPTER_NOT_THE_MODEL]})

    model: ModelSpec
    image: str = Field(..., min_length=1, description="container image with the `tandem` command (workers)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        None, description="Secrets in this namespace with the credentials of a private registry, for every pod")
    engine: DeploymentEngineSpec = Field(default_factory=DeploymentEngineSpec)
    ratio: str | None = Field(None, pattern=RATIO_PATTERN, description="prefill:decode workers, e.g. '1:3'; "
                                                                       "needs spec.replicas")
    replicas: int | None = Field(None, ge=2, le=10000, description="prefill + decode workers, split by "
                                                                  "spec.ratio (at least one of each)")
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    decode: PoolSpec = Field(default_factory=PoolSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    lora_adapters: list[LoraAdapter] | None = Field(
        None, max_length=MAX_LORA_ADAPTERS, description="LoRA adapters mounted read-only into every worker and "
        "loaded at start (--enable-lora --lora-modules); names unique",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)

    @model_validator(mode="after")
    def _pools_are_sized_one_way(self):
        checks = (
            self.ratio is None or self.replicas is not None,
            self.replicas is None or self.ratio is not None,
            self.ratio is None or (self.prefill.replicas is None and self.decode.replicas is None),
            self.ratio is not None or (self.prefill.replicas is not None and self.decode.replicas is not None),
        )
        for ok, rule in zip(checks, _SIZING_RULES):
            if not ok:
                raise ValueError(rule["message"])
        return self

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names_unique(cls, value):
        names = [adapter.name for adapter in value or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapter names must be unique: {', '.join(repeated)} given more than once")
        return value

    @model_validator(mode="after")
    def _adapters_are_not_the_model(self):
        if any(adapter.name == self.model.name for adapter in self.lora_adapters or []):
            raise ValueError(_ADAPTER_NOT_THE_MODEL["message"])
        return self


class PoolStatus(_CamelModel):
    desired: int = 0
    ready: int = 0
    updated: int = 0
    scale_up_from: int | None = Field(None, description="while a scale-up is under way: the ready replicas it "
                                                        "started from (fewer ready is Degraded)")


class Condition(_CamelModel):
    type: Literal["Ready", "Progressing", "Degraded", "SpecValid"]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class PlannerStatus(_CamelModel):
    """The planner's latest decision (planner mode only); the operator sizes the pools from it."""

    prefill: int = Field(..., ge=0)
    decode: int = Field(..., ge=0)
    reason: str = ""
    last_change: str | None = Field(None, description="when the planner last changed the replicas")


class LLMDeploymentStatus(_CamelModel):
    """What the operator reports back (`kubectl get llmdep`)."""

    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] | None = None
    observed_generation: int | None = None
    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None
    router: PoolStatus | None = None
    ready: str | None = Field(None, description="ready/desired pods over both pools and the router")
    ratio: str | None = Field(None, description="effective P:D: ready prefill to ready decode workers")
    endpoint: str | None = Field(None, description="the router's OpenAI-compatible base URL")
    gpus: int | None = Field(None, description="GPUs the desired workers hold: each pool's replicas x its GPUs per "
                                               "worker (its tensorParallelSize), summed; unset on CPU")
    replicas: int | None = Field(None, description="workers both pools are sized for now (the scale subresource's "
                                                   "status.replicas)")
    selector: str | None = Field(None, description="label selector of both pools' worker pods (the scale "
                                                   "subresource's, for autoscalers that average over pods)")
    conditions: list[Condition] | None = Field(
        None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    planner: PlannerStatus | None = Field(None, description="planner mode: its recommendation and reason")
