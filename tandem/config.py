"""Configuration models: the single source of truth for engine, worker and CLI settings.

The LLMDeployment CRD (operator issue) is generated from models in this module too.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from tandem.hashing import DEFAULT_BLOCK_SIZE
from tandem.tool_parsers import ToolCallParserName

Role = Literal["prefill", "decode", "both"]

# tool_choice "auto" (tandem.tool_calls), with vLLM's options. They are read where the answer is formed, by a
# worker's OpenAI server and by the router's alike (both take them), not by the engine; they are EngineConfig's so
# that `tandem serve` passes them on to its workers, as served_model_name.
ToolCallParserOption = Annotated[ToolCallParserName | None, Field(
    description='serve tool_choice "auto" (the default with tools): the model answers freely and this parser reads '
                "its calls out of the text; hermes: <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5, SmolLM2)")]
EnableAutoToolChoiceOption = Annotated[bool, Field(
    description="vLLM's switch for the same, accepted so that vLLM command lines work unchanged; it needs "
                "--tool-call-parser, which alone serves \"auto\" here")]


def _auto_tool_choice_has_a_parser(config):
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (as in vLLM), e.g. --tool-call-parser "
                         "hermes")
    return config


SPECULATIVE_METHODS = ("ngram",)


class SpeculativeConfig(BaseModel):
    """vLLM's --speculative-config, as far as it is implemented here (n-gram prompt lookup)."""

    model_config = ConfigDict(extra="forbid")

    method: str = "ngram"
    num_speculative_tokens: int = Field(..., ge=1, le=32)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _method_known(cls, data):
        if isinstance(data, dict) and data.get("model") is not None and "method" not in data:
            raise ValueError("a draft model is not supported yet; use {\"method\": \"ngram\", ...}")
        if isinstance(data, dict) and data.get("method", "ngram") not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown method {data['method']!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
        return data

    @model_validator(mode="after")
    def _lookup_window(self):
        # vLLM's rule: either bound defaults to the other, both to 5.
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config of a --speculative-config JSON text; ValueError in one line if it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError("; ".join(_located(e) for e in exc.errors())) from None


def _located(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


class EngineConfig(BaseModel):
    """Settings of one engine instance (one worker process)."""

    model: str = Field("smollm2", description="'smollm2', a HF checkpoint folder, or a .gguf file")
    served_model_name: str | None = Field(None, description="name clients use; defaults to the model's")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = Field("auto", description="'auto' picks cuda when present, else cpu")
    max_model_len: int | None = Field(None, ge=1, description="defaults to the model's context length, or to what "
                                        "the KV cache holds when that is less")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache size in blocks; overrides kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV cache size when num_kv_blocks is not given")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1, description="per-step token budget (chunked prefill)")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="auto: triton on CUDA; on CPU 'cpu' (a native paged-attention kernel, built once per "
        "machine) when it builds, else 'torch' (the reference path)")
    quantized_gemv: Literal["auto", "off"] = Field(
        "auto", description="auto: on CPU, decode steps of small batches (up to 16 sequences in float32, 8 in "
        "bfloat16) read a GGUF file's Q4_0/Q4_1/Q8_0 weights in the file's own blocks (a native AVX-512 kernel; "
        "the same weights in 3.8-7x fewer bytes than float32); off: the dequantized weights only")
    tensor_parallel_size: int = Field(1, ge=1, description="processes (one GPU each on CUDA) the model is split "
                                      "over: attention heads, MLP columns and vocabulary rows, one all-reduce per "
                                      "attention and MLP block")
    quantization: Literal["fp8"] | None = Field(None, description="fp8: the decoder layers' GEMM weights in FP8 "
                                                "(e4m3, a scale per output channel), quantized at load from a float "
                                                "checkpoint; activations quantized per token where the GPU has FP8 "
                                                "tensor cores (compute capability 8.9+)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto", description="KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3): e4m3, one byte per "
        "element, with a per-tensor scale per layer (the checkpoint's k_scale/v_scale, else 1.0)")
    enforce_eager: bool = Field(False, description="no CUDA graphs: run decode steps eagerly (on CUDA, decode "
                                "steps of up to min(max_num_seqs, 256) sequences are replayed from graphs)")
    seed: int = 0
    # P/D disaggregation: how KV blocks move between workers, and how long a prefill worker
    # keeps a finished prompt's blocks pinned for the decode worker that will pull them.
    kv_transfer: Literal["auto", "nixl", "tcp"] = Field("auto", description="KV transfer backend; auto = NIXL when it imports")
    kv_transfer_lanes: int = Field(2, ge=1, description="NIXL: reading agents a KV pull is split over, each "
                                   "copying in its own thread")
    kv_lease_ttl_s: float = Field(30.0, gt=0, description="a prefill's pinned blocks are freed after this long")
    kv_pull_timeout_s: float = Field(10.0, gt=0, description="a KV pull slower than this falls back to recompute")
    kv_pull_in_background: Literal["auto", "on", "off"] = Field(
        "auto", description="pull a request's KV on a thread of its own while the running requests' steps go on; "
        "auto: when the KV cache is on a GPU (the NIC or NVLink copies), not on a CPU (there the copy takes the cores "
        "the steps compute with, and costs the running requests as much as a pause or more: "
        "benchmarks/decode_during_pull.py)")
    tool_call_parser: ToolCallParserOption = None
    enable_auto_tool_choice: EnableAutoToolChoiceOption = False
    speculative_config: str | None = Field(
        None, description='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4} (docs/speculative-decoding.md)')

    @field_validator("speculative_config")
    @classmethod
    def _speculative_config_parses(cls, value):
        if value is not None:
            SpeculativeConfig.parse(value)
        return value

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @model_validator(mode="after")
    def _auto_tool_choice(self):
        return _auto_tool_choice_has_a_parser(self)


API_KEY_ENV = "TANDEM_API_KEY"  # the router's key kept off its command line (and out of `ps`), as VLLM_API_KEY


class RouterConfig(BaseModel):
    """Settings of the router: the OpenAI front door before the prefill and decode pools."""

    model: str = Field("smollm2", description="model source, for the tokenizer and chat template")
    served_model_name: str | None = Field(None, description="name clients use; defaults to the model's")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill: list[str] = Field(default_factory=list, description="prefill worker URLs (static discovery)")
    decode: list[str] = Field(default_factory=list, description="decode worker URLs (static discovery)")
    discovery: Literal["static", "kubernetes"] = "static"
    namespace: str | None = Field(None, description="kubernetes discovery: namespace of the EndpointSlices")
    prefill_selector: str | None = Field(None, description="kubernetes discovery: label selector of prefill pods")
    decode_selector: str | None = Field(None, description="kubernetes discovery: label selector of decode pods")
    disagg_min_tokens: int = Field(512, ge=0, description="shorter prompts are served by a decode worker alone")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, description="must match the workers' block size")
    routing_blocks: int = Field(4, ge=1, description="full blocks of the prompt that form the routing key")
    balance_eps: float = Field(1.0, ge=0, description="overload valve: a request leaves its key's worker only "
                               "when that worker holds over (1+eps) x the mean uncached prompt tokens in flight")
    overload_min_tokens: int = Field(2048, ge=0, description="overload valve: a worker with at most this many "
                                     "uncached prompt tokens in flight is not overloaded (about one engine step)")
    decode_balance_eps: float = Field(0.5, ge=0, description="sequence valve, for requests a decode worker serves "
                                      "alone: one leaves its key's worker when that worker holds over (1+eps) x the "
                                      "mean sequences (running and waiting) of the pool")
    decode_overload_min_seqs: int | None = Field(None, ge=1, description="sequence valve: a decode worker holding "
                                                 "fewer sequences than this is not overloaded (a batch this small "
                                                 "decodes about as fast as one sequence); default: an eighth of the "
                                                 "max_num_seqs the worker reports (8 for the default 64), else 8")
    routing_policy: Literal["cache_aware", "round_robin", "least_loaded"] = Field(
        "cache_aware", description="how workers are chosen: cache_aware (sticky bounded-load consistent hashing of "
        "prompts, power of two choices for decodes), or the baselines round_robin and least_loaded")
    key_eps: float = Field(0.0, ge=0, description="sticky key table: no worker holds over ceil((1+eps) x mean) "
                           "active routing keys; higher keeps more keys on their ring owner, lower balances better")
    key_ttl_s: float = Field(600.0, gt=0, description="a routing key unused this long leaves the key table")
    max_routing_keys: int = Field(100_000, ge=1, description="key table size per pool; least recently used go first")
    max_input_tokens: int | None = Field(None, ge=1, description="longer prompts get 400")
    max_output_tokens: int | None = Field(None, ge=1, description="larger max_tokens get 400")
    max_body_bytes: int = Field(1 << 20, ge=1, description="larger request bodies get 413")
    enable_log_requests: bool = Field(False, description="a log line at INFO per request (vLLM's "
                                                         "--enable-log-requests), with its x-request-id")
    api_key: list[str] = Field(default_factory=list, description="/v1/* requests must send one of these as "
                               "`Authorization: Bearer <key>` (401 otherwise), or $TANDEM_API_KEY, or a key of the "
                               "tenants file; with none of these nor its requireApiKey, the API is open")
    disable_fastapi_docs: bool = Field(False, description="serve neither /docs, /redoc nor /openapi.json (vLLM's "
                                       "option); with an API key required, /docs and /redoc need it too")
    allowed_origins: list[str] = Field(default_factory=list, description="browser origins allowed to call the "
                                       "API (CORS), e.g. https://app.example.com, or * for any; none by default")
    tokenize_in_thread_chars: int = Field(512, ge=0, description="prompt texts at least this long are tokenized "
                                          "on a thread, off the event loop (shorter ones in place, sparing the hand-off)")
    gc_young_threshold: int = Field(10_000, ge=1, description="the garbage collector collects its youngest "
                                    "generation per this many net new objects (CPython's default is 700; see "
                                    "tandem/heap.py): higher means fewer pauses and more cyclic garbage waiting")
    worker_transport: Literal["websocket", "http"] = Field(
        "websocket", description="how requests reach workers: multiplexed on one WebSocket per worker (HTTP to a "
        "worker that has none), or an HTTP request each")
    max_in_flight: int = Field(512, ge=1, description="requests dispatched at once; more wait in the EDF queue")
    max_queue: int = Field(1024, ge=1, description="admitted requests waiting for dispatch")
    initial_prefill_tps: float | None = Field(None, gt=0, description="prefill tokens/s per worker before measuring, "
                                              "for workers that report no step cost model")
    admission: Literal["slo", "off"] = Field("slo", description="slo: refuse (429) what is predicted to miss its SLO "
                                             "class's targets and hold streams the decode pool cannot serve at their "
                                             "inter-token target; off: first come, first served within the queue")
    slo_headroom: float = Field(0.1, ge=0, lt=1, description="share of each SLO target kept for what predictions "
                                "miss: admitted when the predicted time is within (1 - headroom) x the target")
    health_interval_s: float = Field(1.0, gt=0, description="how often workers' /ready and load are polled")
    eject_after_failures: int = Field(3, ge=1, description="consecutive failures that take a worker out")
    worker_return_wait_s: float = Field(10.0, ge=0, description="a request under way that finds no decode worker "
                                        "in rotation (a pool of one restarting, a pool frozen for a moment) waits "
                                        "this long for one to come back, then fails with 503 no_workers")
    graceful_shutdown_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight get to "
                                       "finish; those still running then end with 503 shutting_down (streamed: an "
                                       "error event and [DONE])")
    seed: int = 0
    # The router forms the answers it serves (from the workers' tokens): it parses their calls itself.
    tool_call_parser: ToolCallParserOption = None
    enable_auto_tool_choice: EnableAutoToolChoiceOption = False

    @model_validator(mode="after")
    def _auto_tool_choice(self):
        return _auto_tool_choice_has_a_parser(self)


class WorkerConfig(BaseModel):
    """Settings of the worker HTTP server around an engine."""

    role: Role = "both"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(1 << 20, ge=1, description="larger request bodies get 413")
    enable_log_requests: bool = Field(False, description="a log line at INFO per request (vLLM's "
                                                         "--enable-log-requests), with its x-request-id")
    advertise_url: str | None = Field(None, description="URL peers use to reach this worker (default http://host:port)")
    stall_timeout_s: float = Field(300.0, gt=0, description="/health and /ready answer 503 while one engine step "
                                   "has run longer than this (a hung GPU call or a deadlock leaves the engine thread "
                                   "alive): Kubernetes then restarts the pod and routers stop sending to it")
    engine: EngineConfig = Field(default_factory=EngineConfig)


# -- LLMDeployment: the operator's custom resource -------------------------------------------------------
# `crds/llmdeployment.yaml` is generated from the models below (`python -m tandem.crdgen`); a test fails when
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
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
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
_AT_LEAST_ONE_DECODE = _cel("!has(self.decode) || !has(self.decode.replicas) || self.decode.replicas >= 1",
                            "spec.decode.replicas: must be at least 1: decode workers generate every response")


class LLMDeploymentSpec(_CamelModel):
    """What `kubectl apply` asks for: a model served by a prefill pool, a decode pool and a router."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [*_SIZING_RULES, _AT_LEAST_ONE_DECODE]})

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
    conditions: list[Condition] | None = Field(
        None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    planner: PlannerStatus | None = Field(None, description="planner mode: its recommendation and reason")
