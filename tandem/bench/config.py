"""`tandem bench` settings; every field is also a `--kebab-case` option (see tandem/cli/parsers.py)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.bench.distributions import parse_distribution
from tandem.bench.prompts import parse_token_id_range


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field("http://127.0.0.1:8000", description="base URL of an OpenAI-compatible server (an SDK's base URL, "
                                                                  "ending in /v1, is taken too)")
    model: str | None = Field(None, description="model name to send; default: the first one /v1/models lists")
    endpoint: Literal["completions", "chat"] = Field("completions", description="OpenAI API to exercise")
    input_dist: str = Field("fixed:128", description="prompt tokens: fixed:N, uniform:A:B, lognormal:MEAN:SIGMA, "
                                                     "trace:FILE.jsonl")
    output_dist: str = Field("fixed:64", description="output tokens (max_tokens), as --input-dist")
    arrival: Literal["poisson", "constant", "burst"] = Field("poisson", description="arrival process of a rate "
                                                                                   "sweep")
    burst_size: int = Field(8, ge=1, description="requests sent together by --arrival burst")
    concurrency: list[int] | None = Field(None, description="closed-loop sweep: requests kept in flight, one "
                                                            "point per value (default: 1)")
    rate: list[float] | None = Field(None, description="open-loop sweep: requests per second, one point per value")
    requests: int = Field(32, ge=1, description="measured requests per point")
    warmup: int = Field(2, ge=0, description="requests per point sent first and left out of the statistics")
    slo_ttft: float | None = Field(None, gt=0, description="TTFT target, seconds (marks C_max on the curve)")
    slo_itl: float | None = Field(None, gt=0, description="inter-token latency target, seconds")
    slo_percentile: Literal["p50", "p90", "p99"] = Field("p99", description="latency percentile the SLO bounds")
    prompt_style: Literal["auto", "tokens", "words"] = Field(
        "auto", description="prompts of random token ids (exact length) or random words (about one token "
                            "each); auto: tokens for completions, words for chat")
    token_id_range: str = Field("1000:30000", description="LOW:HIGH range of random prompt token ids")
    ignore_eos: Literal["auto", "on", "off"] = Field(
        "auto", description="send ignore_eos so outputs run to max_tokens; auto: on for servers that say "
                            "they are Tandem or vLLM in /v1/models")
    slo_class: str | None = Field(
        "batch", description="x-tandem-slo-class sent to a Tandem router: 'batch' (a 30 s TTFT target) measures how "
                             "the deployment serves; its default 'interactive' class would refuse (429) what it "
                             "predicts late, and the curve would show refusals; '' sends none (the API key's "
                             "class applies). Other servers ignore the header")
    timeout: float = Field(600.0, gt=0, description="per-request timeout, seconds")
    api_key: str | None = Field(None, description="bearer token (default: $OPENAI_API_KEY when set)")
    seed: int = Field(0, description="seed of lengths, prompts and arrival times")
    out: str = Field("bench-results", description="directory for bench.json, summary.csv, requests.csv, "
                                                  "bench.png")
    plot: bool = Field(True, description="write bench.png (needs matplotlib)")

    @field_validator("input_dist")
    @classmethod
    def _input_dist(cls, value):
        parse_distribution(value, "input")
        return value

    @field_validator("output_dist")
    @classmethod
    def _output_dist(cls, value):
        parse_distribution(value, "output")
        return value

    @field_validator("token_id_range")
    @classmethod
    def _token_range(cls, value):
        parse_token_id_range(value)
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value):
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url {value!r} must start with http:// or https://")
        # The SDKs' base URL ends in /v1 (as the README's examples do), and users paste it: the paths bench asks
        # for (/v1/models, /v1/completions) already begin with it.
        parts = urlsplit(value.rstrip("/"))
        return urlunsplit(parts._replace(path=parts.path.removesuffix("/v1")))

    @model_validator(mode="after")
    def _one_sweep(self):
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("sweep either --concurrency or --rate, not both")
        if self.concurrency is not None and (not self.concurrency or min(self.concurrency) < 1):
            raise ValueError(f"concurrency values must be at least 1, got {self.concurrency}")
        if self.rate is not None and (not self.rate or min(self.rate) <= 0):
            raise ValueError(f"rates must be positive requests per second, got {self.rate}")
        if self.endpoint == "chat" and self.prompt_style == "tokens":
            raise ValueError("chat requests take text: use --prompt-style words (or auto) with --endpoint chat")
        return self

    @property
    def sweep(self) -> tuple[Literal["concurrency", "rate"], list]:
        if self.rate is not None:
            return "rate", list(self.rate)
        return "concurrency", list(self.concurrency or [1])

    @property
    def effective_prompt_style(self) -> Literal["tokens", "words"]:
        if self.prompt_style != "auto":
            return self.prompt_style
        return "words" if self.endpoint == "chat" else "tokens"
