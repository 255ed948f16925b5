"""Configuration models: the single source of truth for engine, worker, router and CLI settings.

The operator's LLMDeployment models are in operator/crd.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.hashing import DEFAULT_BLOCK_SIZE
from tandem.openai.tool_parsers import ToolCallParserName

Role = Literal["prefill", "decode", "both"]

# tool_choice "auto" (tandem.openai.tool_calls), with vLLM's options. They are read where the answer is formed, by a
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
    # Multi-LoRA (docs/lora.md), vLLM's flags and defaults.
    enable_lora: bool = Field(False, description="serve LoRA adapters on the base model (chosen by `model`)")
    lora_modules: list[str] = Field(default_factory=list, description="adapters loaded at start, NAME=PATH each "
                                    "(a PEFT folder)")
    max_lora_rank: int = Field(16, ge=1, description="the largest adapter rank served")
    max_loras: int = Field(1, ge=1, description="adapters resident on the device, usable in one step")
    max_cpu_loras: int | None = Field(None, ge=1, description="adapters cached in host memory (LRU); default "
                                      "max_loras")

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

    @model_validator(mode="after")
    def _lora_fits(self):
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA with --tensor-parallel-size > 1 is not supported yet")
        return self


# The HTTP server's options the router and a worker take alike.
MaxBodyBytesOption = Annotated[int, Field(ge=1, description="larger request bodies get 413")]
EnableLogRequestsOption = Annotated[bool, Field(description="a log line at INFO per request (vLLM's "
                                                            "--enable-log-requests), with its x-request-id")]


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
    max_body_bytes: MaxBodyBytesOption = 1 << 20
    enable_log_requests: EnableLogRequestsOption = False
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
                                    "tandem/server/heap.py): higher means fewer pauses and more cyclic garbage waiting")
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
    max_body_bytes: MaxBodyBytesOption = 1 << 20
    enable_log_requests: EnableLogRequestsOption = False
    advertise_url: str | None = Field(None, description="URL peers use to reach this worker (default http://host:port)")
    stall_timeout_s: float = Field(300.0, gt=0, description="/health and /ready answer 503 while one engine step "
                                   "has run longer than this (a hung GPU call or a deadlock leaves the engine thread "
                                   "alive): Kubernetes then restarts the pod and routers stop sending to it")
    engine: EngineConfig = Field(default_factory=EngineConfig)
