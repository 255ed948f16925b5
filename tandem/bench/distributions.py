"""Token-length distributions and arrival processes for the load generator (and the planner's means).

A length distribution is written as one string, the same on the command line, in a workload profile and in
the conditions `tandem bench` records:

    fixed:N               every request N tokens (a bare number N means the same)
    uniform:A:B           integers drawn uniformly from [A, B]
    lognormal:MEAN:SIGMA  a log-normal whose *mean* is MEAN tokens and whose log has standard deviation
                          SIGMA (so mu = ln(MEAN) - SIGMA^2 / 2); the usual shape of real prompt lengths
    trace:FILE.jsonl      lengths replayed in file order, cycling; each line is a JSON object with the
                          input length under input_tokens | prompt_tokens | input_length and the output
                          length under output_tokens | completion_tokens | output_length

Drawn lengths are integers of at least 1. When the input and output distributions are the same trace, the
i-th request gets the i-th line's input *and* output length, so the trace's correlation between them is kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Column = Literal["input", "output"]
TRACE_KEYS: dict[str, tuple[str, ...]] = {
    "input": ("input_tokens", "prompt_tokens", "input_length"),
    "output": ("output_tokens", "completion_tokens", "output_length"),
}


class LengthDistribution:
    spec: str

    @property
    def mean(self) -> float:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths (int64, each >= 1)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(LengthDistribution):
    tokens: int

    def __post_init__(self):
        if self.tokens < 1:
            raise ValueError(f"fixed length must be at least 1 token, got {self.tokens}")

    @property
    def spec(self) -> str:
        return f"fixed:{self.tokens}"

    @property
    def mean(self) -> float:
        return float(self.tokens)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform(LengthDistribution):
    low: int
    high: int

    def __post_init__(self):
        if not 1 <= self.low <= self.high:
            raise ValueError(f"uniform:{self.low}:{self.high} needs 1 <= A <= B")

    @property
    def spec(self) -> str:
        return f"uniform:{self.low}:{self.high}"

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal(LengthDistribution):
    mean_tokens: float
    sigma: float

    def __post_init__(self):
        if not (math.isfinite(self.mean_tokens) and self.mean_tokens >= 1):
            raise ValueError(f"lognormal mean must be at least 1 token, got {self.mean_tokens}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be >= 0, got {self.sigma}")

    @property
    def spec(self) -> str:
        return f"lognormal:{self.mean_tokens:g}:{self.sigma:g}"

    @property
    def mu(self) -> float:
        return math.log(self.mean_tokens) - self.sigma**2 / 2

    @property
    def mean(self) -> float:
        # The mean of the continuous law; rounding and the floor of 1 token move it by well under a token.
        return float(self.mean_tokens)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        draws = rng.lognormal(self.mu, self.sigma, size=n)
        return np.maximum(np.rint(draws), 1).astype(np.int64)


@dataclass(frozen=True)
class Trace(LengthDistribution):
    path: str
    column: Column
    lengths: tuple[int, ...]

    @property
    def spec(self) -> str:
        return f"trace:{self.path}"

    @property
    def mean(self) -> float:
        return float(np.mean(self.lengths))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The first n lengths in file order, cycling: replay, not resampling (rng is not used)."""
        reps = -(-n // len(self.lengths))
        return np.tile(np.asarray(self.lengths, dtype=np.int64), reps)[:n]


def load_trace(path: str, column: Column) -> Trace:
    keys = TRACE_KEYS[column]
    lengths = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"trace {path}: cannot read it ({exc.strerror})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace {path}:{number}: not JSON ({exc.msg})") from None
        value = next((record[k] for k in keys if isinstance(record, dict) and k in record), None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"trace {path}:{number}: needs a positive integer {column} length under one of "
                             f"{', '.join(keys)}")
        lengths.append(value)
    if not lengths:
        raise ValueError(f"trace {path}: no records")
    return Trace(path, column, tuple(lengths))


def parse_distribution(spec: str | int | float, column: Column = "input") -> LengthDistribution:
    """Parse a length distribution (see the module docstring); `column` picks a trace's field."""
    if isinstance(spec, bool):
        raise ValueError(f"length distribution {spec!r} is not a number or a distribution")
    if isinstance(spec, (int, float)):
        spec = str(int(spec)) if float(spec).is_integer() else str(spec)
    text = spec.strip()
    kind, _, rest = text.partition(":")
    try:
        if not rest and kind.lstrip("+-").isdigit():
            return Fixed(_positive_int(kind))
        if kind == "trace":
            return load_trace(rest, column)
        args = rest.split(":")
        if kind == "fixed" and len(args) == 1:
            return Fixed(_positive_int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return Uniform(_positive_int(args[0]), _positive_int(args[1]))
        if kind == "lognormal" and len(args) == 2:
            return LogNormal(float(args[0]), float(args[1]))
    except ValueError as exc:
        raise ValueError(f"length distribution {text!r}: {exc}") from None
    raise ValueError(f"length distribution {text!r} must be N, fixed:N, uniform:A:B, lognormal:MEAN:SIGMA "
                     "or trace:FILE.jsonl")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


# -- arrivals --------------------------------------------------------------------------------------------

Arrival = Literal["poisson", "constant", "burst"]


def arrival_times(kind: Arrival, rate: float, n: int, rng: np.random.Generator, burst_size: int = 8) -> np.ndarray:
    """Send times in seconds from the start (first at 0) for n requests at a mean of `rate` per second.

    poisson: exponential gaps (memoryless arrivals, what many independent users produce);
    constant: evenly spaced; burst: groups of `burst_size` sent at once, a group every burst_size / rate s.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"arrival rate must be a positive number of requests per second, got {rate}")
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
        return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:n] if n else np.zeros(0)
    if kind == "constant":
        return np.arange(n) / rate
    if kind == "burst":
        if burst_size < 1:
            raise ValueError(f"burst size must be at least 1, got {burst_size}")
        return (np.arange(n) // burst_size) * (burst_size / rate)
    raise ValueError(f"arrival process {kind!r} must be poisson, constant or burst")
