"""The workload profile `tandem plan` sizes a fleet for (YAML file or command-line flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.bench.distributions import LengthDistribution, parse_distribution


class WorkloadProfile(BaseModel):
    """Peak load, lengths, SLOs and hardware; every field is also a `tandem plan --kebab-case` flag."""

    model_config = ConfigDict(extra="forbid")

    peak_rps: float | None = Field(None, gt=0, description="peak arrival rate the fleet must serve, requests/s")
    input_tokens: str = Field("512", description="input length: a mean N, or uniform:A:B, lognormal:MEAN:SIGMA, "
                                                 "trace:FILE.jsonl")
    output_tokens: str = Field("128", description="output length, as input_tokens")
    slo_ttft: float | None = Field(None, gt=0, description="time-to-first-token target, seconds")
    slo_itl: float | None = Field(None, gt=0, description="inter-token latency target, seconds")
    slo_percentile: Literal["p50", "p90", "p99"] = Field("p99", description="latency percentile the SLO "
                                                                           "bounds")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per instance (tensor parallel size)")
    prefill_tensor_parallel_size: int | None = Field(None, ge=1, le=64, description="GPUs per prefill worker; "
                                                                                   "default: tensor_parallel_size")
    decode_tensor_parallel_size: int | None = Field(None, ge=1, le=64, description="GPUs per decode worker; "
                                                                                  "default: tensor_parallel_size")
    safety_factor: float = Field(1.3, ge=1.0, le=10.0, description="headroom multiplier on GPUs and replicas")
    prefill_tok_s: float | None = Field(None, gt=0, description="prompt tokens/s one prefill worker computes; "
                                                                "default: fitted from the curve")
    decode_tok_s: float | None = Field(None, gt=0, description="tokens/s one decode worker generates (all its "
                                                               "sequences) within the ITL SLO; default: fitted "
                                                               "from the curve")
    decode_step_s: float | None = Field(None, gt=0, description="decode step time (ITL) of a decode worker's "
                                                                "batch without prefills; default: the curve's "
                                                                "P50 ITL at C_max")
    max_queue_wait: float | None = Field(None, gt=0, description="longest a request may wait for admission, "
                                                                 "seconds; default: the TTFT SLO")
    queue_arrival_rps: float | None = Field(None, gt=0, description="arrival rate one admission queue sees "
                                                                    "(peak RPS / router replicas); default: "
                                                                    "peak RPS")
    ratio_max_term: int = Field(8, ge=1, le=100, description="largest term of the reduced P:D ratio")

    @field_validator("input_tokens", "output_tokens", mode="before")
    @classmethod
    def _lengths_as_text(cls, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(int(value)) if float(value).is_integer() else str(value)
        return value

    @field_validator("input_tokens", "output_tokens")
    @classmethod
    def _valid_distribution(cls, value, info):
        parse_distribution(value, "input" if info.field_name == "input_tokens" else "output")
        return value

    def pool_tp(self, pool: str) -> int:
        """GPUs per worker of `pool` (prefill or decode)."""
        own = getattr(self, f"{pool}_tensor_parallel_size")
        return self.tensor_parallel_size if own is None else own

    @property
    def input_distribution(self) -> LengthDistribution:
        return parse_distribution(self.input_tokens, "input")

    @property
    def output_distribution(self) -> LengthDistribution:
        return parse_distribution(self.output_tokens, "output")


def load_profile_file(path: str | Path) -> dict:
    """The raw mapping of a profile YAML file (validated later, after command-line flags override it)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"profile {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"profile {path}: not valid YAML ({exc})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"profile {path}: must be a mapping of profile fields")
    unknown = sorted(set(doc) - set(WorkloadProfile.model_fields))
    if unknown:
        raise ValueError(f"profile {path}: unknown fields {', '.join(unknown)} "
                         f"(known: {', '.join(WorkloadProfile.model_fields)})")
    try:
        WorkloadProfile(**doc)
    except ValidationError as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    return doc
