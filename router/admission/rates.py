"""Measured service rates: prefill and decode tokens per second, smoothed with an EWMA."""

from __future__ import annotations

import math


class EWMARate:
    """Tokens per second from (tokens, seconds) measurements.

    The rate is the ratio of an EWMA of tokens to an EWMA of seconds rather than an EWMA of per-sample
    tokens/s: each measurement then counts in proportion to the work it covered, so a run of tiny prefills
    whose fixed overhead dominates cannot drag down the rate that the long prompts in the queue will see.
    `initial_tps` is a prior used until the first measurement, which replaces it.
    """

    def __init__(self, alpha: float = 0.2, initial_tps: float | None = None):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if initial_tps is not None and not (math.isfinite(initial_tps) and initial_tps > 0):
            raise ValueError(f"initial_tps must be a positive rate, got {initial_tps}")
        self.alpha = alpha
        self.initial_tps = initial_tps
        self.samples = 0
        self._tokens = 0.0
        self._seconds = 0.0

    def record(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if self.samples == 0:
            if seconds == 0:  # work that shared its time with another's: no rate to start from
                return
            self._tokens, self._seconds = tokens, seconds
        else:
            self._tokens += self.alpha * (tokens - self._tokens)
            self._seconds += self.alpha * (seconds - self._seconds)
        self.samples += 1

    @property
    def tokens_per_s(self) -> float | None:
        """The smoothed rate; the prior before any measurement; None when there is neither."""
        if self.samples == 0:
            return self.initial_tps
        return self._tokens / self._seconds


class ServiceRates:
    """The router's running estimate of how fast workers serve, fed as requests complete.

    `record_prefill` takes the uncached prompt tokens one prefill computed and the seconds of worker time it is
    charged with (router.pool.Worker.prefill_started: prefills in flight together share the worker's seconds,
    so the rate is a worker's throughput, not one request's speed); `record_decode` the tokens one request
    generated and its decode time (so its rate is per sequence, about 1 / inter-token latency). Admission uses
    the prefill rate; the decode rate is there for the planner and for reporting.
    """

    def __init__(self, alpha: float = 0.2, initial_prefill_tps: float | None = None,
                 initial_decode_tps: float | None = None):
        self.prefill = EWMARate(alpha, initial_prefill_tps)
        self.decode = EWMARate(alpha, initial_decode_tps)

    def record_prefill(self, tokens: float, seconds: float) -> None:
        self.prefill.record(tokens, seconds)

    def record_decode(self, tokens: float, seconds: float) -> None:
        self.decode.record(tokens, seconds)

    @property
    def prefill_tps(self) -> float | None:
        return self.prefill.tokens_per_s

    @property
    def decode_tps(self) -> float | None:
        return self.decode.tokens_per_s
