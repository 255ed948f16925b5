"""Synthetic request traces for the simulator: a diurnal arrival rate, Poisson arrivals, drawn lengths."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tandem.bench.distributions import LengthDistribution

DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class DiurnalRate:
    """rate(t) = peak x (trough + (1 - trough) x (1 - cos(2 pi (t - low_at_s) / period_s)) / 2).

    The rate is lowest (`trough` x peak) at `low_at_s` and highest (peak) half a period later; the defaults
    give a day with its quietest moment at 04:00 and its busiest at 16:00.
    """

    peak_rps: float
    trough: float = 0.25
    low_at_s: float = 4 * 3600.0
    period_s: float = DAY_S

    def __post_init__(self):
        if not (math.isfinite(self.peak_rps) and self.peak_rps > 0):
            raise ValueError(f"diurnal rate: peak_rps must be > 0, got {self.peak_rps}")
        if not 0 <= self.trough <= 1:
            raise ValueError(f"diurnal rate: trough must be in [0, 1], got {self.trough}")
        if self.period_s <= 0:
            raise ValueError(f"diurnal rate: period_s must be > 0, got {self.period_s}")

    def __call__(self, t):
        phase = 2 * np.pi * (np.asarray(t, dtype=float) - self.low_at_s) / self.period_s
        return self.peak_rps * (self.trough + (1 - self.trough) * (1 - np.cos(phase)) / 2)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival: times in seconds and token lengths."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)


def poisson_trace(rate, duration_s: float, input_dist: LengthDistribution, output_dist: LengthDistribution,
                  rng: np.random.Generator, bin_s: float = 1.0) -> Trace:
    """A non-homogeneous Poisson process: in each `bin_s` slice, Poisson(rate(mid) x bin_s) arrivals spread
    uniformly over the slice (exact for a rate that is constant within a slice)."""
    if duration_s <= 0 or bin_s <= 0:
        raise ValueError(f"trace: duration ({duration_s}) and bin ({bin_s}) must be > 0")
    starts = np.arange(0.0, duration_s, bin_s)
    widths = np.minimum(bin_s, duration_s - starts)
    counts = rng.poisson(np.asarray(rate(starts + widths / 2)) * widths)
    times = np.repeat(starts, counts) + rng.random(counts.sum()) * np.repeat(widths, counts)
    times.sort()
    n = len(times)
    return Trace(times, input_dist.sample(rng, n), output_dist.sample(rng, n))
