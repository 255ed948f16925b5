"""Measured service rates: prefill and decode tokens per second, exponentially smoothed over the time measured."""

from __future__ import annotations

import math


class EWMARate:
    """Tokens per second from (tokens, seconds) measurements.

    The rate is the ratio of a decaying sum of tokens to a decaying sum of seconds rather than an average of
    per-sample tokens/s: each measurement then counts in proportion to the work it covered, so a run of tiny
    prefills whose fixed overhead dominates cannot drag down the rate that the long prompts in the queue will see.
    Both sums decay with the seconds measured (by half every `half_life_s`), not with the number of measurements:
    prefill measurements are shares of their worker's busy time (router.pool.Worker.prefill_started), so the rate
    is the worker's over its last few seconds of work however many requests those were split into. Decaying per
    measurement instead weighed a burst's requests by the order they finished in: of 16 prefills done in one step,
    the one that computed a shared prefix for all of them counted for little once the 15 that each computed a few
    tokens after it were recorded, and the rate came out far below what the worker had just done.
    `initial_tps` is a prior used until the first measurement, which replaces it.
    """

    def __init__(self, half_life_s: float = 2.0, initial_tps: float | None = None):
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be a positive number of seconds, got {half_life_s}")
        if initial_tps is not None and not (math.isfinite(initial_tps) and initial_tps > 0):
            raise ValueError(f"initial_tps must be a positive rate, got {initial_tps}")
        self.half_life_s = half_life_s
        self.initial_tps = initial_tps
        self.samples = 0
        self._tokens = 0.0
        self._seconds = 0.0

    def record(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if seconds == 0:  # work that shared its time with another's: its tokens are in their rate, no time of its own
            return
        if self.samples == 0:
            self._tokens, self._seconds = tokens, seconds
        else:
            # One measurement counts for at most half_life_s of work, and halves what came before at most: a prefill
            # charged a long time (stalled, or waiting in its engine for room) moves the rate, not replace it.
            weight = min(1.0, self.half_life_s / seconds)
            kept = 0.5 ** (min(seconds, self.half_life_s) / self.half_life_s)
            self._tokens = self._tokens * kept + tokens * weight
            self._seconds = self._seconds * kept + seconds * weight
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

    OUTPUT_ALPHA = 0.05  # weight of the newest request's output length in its running mean

    def __init__(self, half_life_s: float = 2.0, initial_prefill_tps: float | None = None,
                 initial_decode_tps: float | None = None):
        self.prefill = EWMARate(half_life_s, initial_prefill_tps)
        self.decode = EWMARate(half_life_s, initial_decode_tps)
        # The mean output of requests that ended by themselves (EOS or a stop), None before the first.
        self.natural_output_tokens: float | None = None

    def record_output(self, tokens: int, stopped: bool) -> None:
        """A request finished having made `tokens` tokens; `stopped`: it ended by itself (EOS or a stop), not at its
        max_tokens (which says only that it would have gone on)."""
        if stopped:
            mean = self.natural_output_tokens
            self.natural_output_tokens = tokens if mean is None else mean + self.OUTPUT_ALPHA * (tokens - mean)

    def expected_output(self, max_tokens: int, ignore_eos: bool = False) -> int:
        """The tokens a request allowed `max_tokens` is expected to make: all of them when it ignores EOS or nothing
        has ended by itself yet, else the mean of those that did, within its limit."""
        if ignore_eos or self.natural_output_tokens is None:
            return max_tokens
        return max(1, min(max_tokens, round(self.natural_output_tokens)))

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
