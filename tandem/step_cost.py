"""How long an engine step takes: a linear model over what the step computes, fitted by the worker and read by
routers to predict time to first token and inter-token latency (docs/admission.md, "The step cost model").

A step's seconds = base + per_token x tokens + per_sequence x sequences sampled + per_pair x attention pairs, where
attention pairs are the (query token, key) pairs the step's attention scores: a chunk of n new tokens after
`start` tokens already in the cache scores n x start + n (n + 1) / 2 of them, so a long prompt costs more per
token than a short one, as attention makes it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

FEATURES = ("base_s", "token_s", "sequence_s", "pair_s", "decode_base_s", "decode_sequence_s", "decode_pair_s")


def attention_pairs(start: int, new_tokens: int) -> int:
    """(query, key) pairs scored by `new_tokens` tokens computed after `start` cached ones (causal)."""
    return new_tokens * start + new_tokens * (new_tokens + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """Seconds per step and per unit of work; all >= 0. The first four time steps that compute prompt tokens; the
    `decode_` ones steps of decodes alone (one token each), whose time is what a stream waits between tokens."""

    base_s: float
    token_s: float
    sequence_s: float
    pair_s: float
    decode_base_s: float
    decode_sequence_s: float
    decode_pair_s: float

    def __post_init__(self):
        for name in FEATURES:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"step cost {name} must be a finite number >= 0, got {value!r}")

    def step_s(self, tokens: float, sequences: float, pairs: float) -> float:
        """A step that computes prompt tokens: `tokens` in all, `sequences` sampling, `pairs` attention pairs."""
        return self.base_s + self.token_s * tokens + self.sequence_s * sequences + self.pair_s * pairs

    def decode_step_s(self, sequences: float, context_tokens: float) -> float:
        """A step of `sequences` decodes whose contexts add up to `context_tokens`."""
        return self.decode_base_s + self.decode_sequence_s * sequences + self.decode_pair_s * context_tokens

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, budget: int = 2048, decodes: int = 0,
                  decode_context_tokens: float = 0.0) -> float:
        """Seconds to compute a prompt's `new_tokens` after `cached_tokens`, in chunks of what the per-step
        `budget` leaves beside `decodes` running sequences (whose decodes each of its steps carries), its first
        token sampled at the end."""
        if new_tokens <= 0:
            return 0.0
        per_chunk = max(1, budget - decodes)
        chunks = -(-new_tokens // per_chunk)
        shared = self.base_s + self.decode_sequence_s * decodes + self.decode_pair_s * decode_context_tokens
        return chunks * shared + self.token_s * new_tokens + self.sequence_s \
            + self.pair_s * attention_pairs(cached_tokens, new_tokens)

    def largest_batch_within(self, seconds: float, context_per_sequence: float, limit: int) -> int:
        """The most decodes (up to `limit`) whose step takes at most `seconds`; 0 when even one does not fit."""
        per_sequence = self.decode_sequence_s + self.decode_pair_s * context_per_sequence
        room = seconds - self.decode_base_s
        if room < per_sequence:
            return 0
        if per_sequence <= 0 or room / per_sequence >= limit:  # (also where the division overflows to inf)
            return limit
        return int(room / per_sequence)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> StepCost:
        """ValueError for anything that is not a whole, valid model."""
        if not isinstance(data, dict):
            raise ValueError(f"a step cost is an object, got {type(data).__name__}")
        try:
            return cls(**{name: float(data[name]) for name in FEATURES})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a step cost needs {', '.join(FEATURES)}: {exc!r}") from None


class StepTail:
    """How much longer than predicted the gaps between a worker's steps run at worst: the 99th percentile of
    (time from one step's end to the next's) / (the next step's predicted time) over the last `window` steps with
    sequences waiting on them. What the model's mean misses (other work on the cores, a KV pull waited for, the
    serving loop) shows here: a router multiplies its predicted steps by it where a stream's worst gap matters."""

    QUANTILE = 0.99

    def __init__(self, window: int = 256):
        self._ratios: deque[float] = deque(maxlen=window)

    def add(self, interval_s: float, predicted_s: float) -> None:
        if predicted_s > 0 and math.isfinite(interval_s) and interval_s > 0:
            self._ratios.append(interval_s / predicted_s)

    @property
    def factor(self) -> float:
        """The quantile of the ratios, at least 1 (1 before any)."""
        if not self._ratios:
            return 1.0
        ordered = sorted(self._ratios)
        return max(1.0, ordered[min(len(ordered) - 1, int(self.QUANTILE * len(ordered)))])


class _DecayingLeastSquares:
    """Weighted least squares in normal-equation form: a prior part kept at full weight, and measured rows whose
    weight halves for every `half_life_s` seconds of rows measured after them. Each row is weighted by 1 / its
    seconds (relative errors), so that short and long steps both count."""

    def __init__(self, features: int, half_life_s: float):
        self.half_life_s = half_life_s
        self._prior = (np.zeros((features, features)), np.zeros(features))
        self._measured = (np.zeros((features, features)), np.zeros(features))
        self.rows = 0

    def add(self, x: np.ndarray, seconds: float, prior: bool) -> None:
        w = 1.0 / seconds
        xtx, xty = self._prior if prior else self._measured
        if prior:
            self._prior = (xtx + w * np.outer(x, x), xty + w * x * seconds)
        else:
            kept = 0.5 ** (seconds / self.half_life_s)
            self._measured = (xtx * kept + w * np.outer(x, x), xty * kept + w * x * seconds)
        self.rows += 1

    def solve(self) -> list[float]:
        (prior_xtx, prior_xty), (xtx, xty) = self._prior, self._measured
        return _nonnegative_solve(prior_xtx + xtx, prior_xty + xty)


class StepCostFit:
    """A StepCost fitted by least squares to measured steps, the newer ones weighing more.

    Steps that compute prompt tokens fit the first four coefficients, steps of decodes alone the `decode_` ones:
    one line through both would let thousands of short decode steps pull the prefill terms, and the other way
    round. Each fit decays with the seconds measured (half every `half_life_s`); a `prior` set of steps (the
    worker's start-up calibration) stays at full weight, so the fits are determined however alike the steps of the
    moment are. Coefficients are kept >= 0 (one the unconstrained fit makes negative is fixed at 0 and the others
    refitted).
    """

    REFRESH_S = 0.5  # the fit is solved again at most this often: a solve is too costly to repeat at every step

    def __init__(self, half_life_s: float = 30.0, clock=time.monotonic):
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be a positive number of seconds, got {half_life_s}")
        self.half_life_s = half_life_s
        self._prefill = _DecayingLeastSquares(4, half_life_s)
        self._decode = _DecayingLeastSquares(3, half_life_s)
        self._cached: StepCost | None = None
        self._solved_at = -math.inf
        self._clock = clock
        self._lock = threading.Lock()  # the engine thread adds, the server's reads the model

    @property
    def samples(self) -> int:
        return self._prefill.rows + self._decode.rows

    def add(self, tokens: float, sequences: float, pairs: float, seconds: float, prior: bool = False) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            if tokens == sequences:  # every sequence computed one token: decodes alone
                self._decode.add(np.array([1.0, sequences, pairs]), seconds, prior)
            else:
                self._prefill.add(np.array([1.0, tokens, sequences, pairs]), seconds, prior)
            if prior:
                self._solved_at = -math.inf  # the calibration's model at once

    def cost(self) -> StepCost | None:
        """The fitted model (solved again at most every REFRESH_S); None until steps of both kinds were added."""
        now = self._clock()
        with self._lock:
            if not self._prefill.rows or not self._decode.rows:
                return None
            if self._cached is None or now - self._solved_at >= self.REFRESH_S:
                self._cached = StepCost(*self._prefill.solve(), *self._decode.solve())
                self._solved_at = now
            return self._cached


def _nonnegative_solve(xtx: np.ndarray, xty: np.ndarray) -> list[float]:
    """argmin ||y - X b|| over b >= 0, from the normal equations: features whose coefficient comes out negative are
    dropped one at a time (the most negative first) until none is."""
    active = list(range(len(xty)))
    coef = np.zeros(len(xty))
    while active:
        sub = xtx[np.ix_(active, active)]
        # lstsq rather than solve: features no step varied (every step sampled one sequence) leave sub singular.
        solution = np.linalg.lstsq(sub, xty[active], rcond=None)[0]
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    return [float(c) for c in coef]
