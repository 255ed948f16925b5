"""Latency-throughput curves: reading them, and the points that size a fleet (C_max, the knee, usable RPS).

A curve is a list of operating points of ONE instance, one per concurrency (or arrival rate) a benchmark
ran at, each with its throughput and latency percentiles. `tandem bench` writes them (the `points[].summary`
of its JSON); a hand-made curve is a YAML or JSON file with `points:` holding the same flat keys.

Definitions (the field guide's method):
  C_max       the highest concurrency whose latency percentile meets both the TTFT and the ITL SLO, scanning
              up from the lowest: the first point that misses ends the scan, so a noisy pass beyond a miss is
              not trusted. It is a measured point, never interpolated: it has not been shown beyond that.
  usable RPS  what one instance sustains at C_max, by Little's law: C_max / mean E2E latency at C_max.
  knee        where throughput stops paying for added concurrency: the Kneedle point (Satopaa et al., 2011)
              of the throughput curve, i.e. the point farthest above the chord from the first to the last
              point after both axes are scaled to [0, 1]. None while the curve is still about straight.
  Little gap  concurrency vs throughput x mean latency; a benchmark more than 2x off did not run what it
              claims (a client-side connection cap, long idle tails, failed requests left out, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import yaml

Percentile = Literal["p50", "p90", "p99"]
PERCENTILES: tuple[str, ...] = ("p50", "p90", "p99")
# A curve whose largest gap above its chord (on the unit square) is smaller than this is called straight.
KNEE_MIN_BEND = 0.05


# The optional fields of a curve point, each a measured figure (seconds, per second or tokens).
MEASURED_FIELDS = ("request_throughput", "output_throughput", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s",
                   "itl_p90_s", "itl_p99_s", "tpot_p50_s", "mean_input_tokens", "mean_output_tokens")


@dataclass(frozen=True)
class CurvePoint:
    """One operating point. Latencies are in seconds; `concurrency` is the requests in flight (the target of a
    concurrency sweep, or the time-averaged in-flight count the client measured in a rate sweep)."""

    concurrency: float
    e2e_mean_s: float
    request_throughput: float | None = None
    output_throughput: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None
    itl_p99_s: float | None = None
    tpot_p50_s: float | None = None
    mean_input_tokens: float | None = None
    mean_output_tokens: float | None = None

    def __post_init__(self):
        if not (math.isfinite(self.concurrency) and self.concurrency > 0):
            raise ValueError(f"curve point: concurrency must be > 0, got {self.concurrency}")
        if not (math.isfinite(self.e2e_mean_s) and self.e2e_mean_s > 0):
            raise ValueError(f"curve point at concurrency {self.concurrency:g}: e2e_mean_s must be > 0, "
                             f"got {self.e2e_mean_s}")
        for name in MEASURED_FIELDS:  # a NaN or negative latency would pass every SLO test (value > target)
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"curve point at concurrency {self.concurrency:g}: {name} must be a finite number "
                                 f">= 0, got {value}")

    def latency(self, metric: Literal["ttft", "itl"], percentile: Percentile) -> float | None:
        if percentile not in PERCENTILES:
            raise ValueError(f"percentile {percentile!r} must be one of {', '.join(PERCENTILES)}")
        return getattr(self, f"{metric}_{percentile}_s")

    @property
    def usable_rps(self) -> float:
        """The request rate one instance sustains at this concurrency: the throughput measured there when the point
        has it, else Little's law's concurrency / E2E latency (which does not see the time the sweep spent ramping
        up and down, so it can overstate what was measured)."""
        return self.request_throughput if self.request_throughput else self.concurrency / self.e2e_mean_s

    @property
    def usable_rps_basis(self) -> str:
        """Where usable_rps comes from, as reports say it."""
        if self.request_throughput:
            return f"throughput measured at concurrency {self.concurrency:g}"
        return f"C_max / E2E = {self.concurrency:g} / {self.e2e_mean_s:.3f} s"

    @classmethod
    def from_summary(cls, summary: dict) -> CurvePoint:
        """From a `tandem bench` point summary (or a hand-made point with the same keys)."""
        known = {f.name for f in fields(cls)}
        values = {k: summary[k] for k in known if summary.get(k) is not None}
        missing = [k for k in ("concurrency", "e2e_mean_s") if k not in values]
        if missing:
            raise ValueError(f"curve point {summary!r} lacks {', '.join(missing)}")
        try:
            return cls(**{k: float(v) for k, v in values.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"curve point {summary!r}: {exc}") from None


def points_from_document(doc: dict) -> list[CurvePoint]:
    """Curve points from a parsed bench result (points[].summary) or a hand-made curve (points[])."""
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list) or not doc["points"]:
        raise ValueError("a curve needs a non-empty 'points' list")
    out = []
    for item in doc["points"]:
        summary = item.get("summary", item) if isinstance(item, dict) else None
        if not isinstance(summary, dict):
            raise ValueError(f"curve point {item!r} is not a mapping")
        if summary.get("failed", 0) or summary.get("completed", 1) == 0:
            # Requests that failed (a 429 says in milliseconds) did not load the server as the point claims:
            # its throughput and latency would mislead the knee, C_max and a plan.
            continue
        out.append(CurvePoint.from_summary(summary))
    if not out:
        raise ValueError("the curve has no point whose requests all completed")
    return sorted(out, key=lambda p: p.concurrency)


def load_curve(path: str | Path) -> list[CurvePoint]:
    """Read a curve from `tandem bench`'s JSON or a hand-made YAML/JSON file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"curve {path}: cannot read it ({exc.strerror})") from None
    try:
        doc = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"curve {path}: not valid JSON/YAML ({exc})") from None
    try:
        return points_from_document(doc)
    except ValueError as exc:
        raise ValueError(f"curve {path}: {exc}") from None


def meets_slo(point: CurvePoint, slo_ttft_s: float | None, slo_itl_s: float | None,
              percentile: Percentile = "p99") -> bool:
    for metric, target in (("ttft", slo_ttft_s), ("itl", slo_itl_s)):
        if target is None:
            continue
        value = point.latency(metric, percentile)
        if value is None:
            raise ValueError(f"curve point at concurrency {point.concurrency:g} has no {metric} {percentile} "
                             f"to check the {metric.upper()} SLO against")
        if value > target:
            return False
    return True


def find_c_max(points: list[CurvePoint], slo_ttft_s: float | None, slo_itl_s: float | None,
               percentile: Percentile = "p99") -> CurvePoint | None:
    """The point at C_max (see the module docstring), or None when even the lowest concurrency misses."""
    if slo_ttft_s is None and slo_itl_s is None:
        raise ValueError("C_max needs an SLO: give a TTFT target, an ITL target, or both")
    for target in (slo_ttft_s, slo_itl_s):
        if target is not None and not (math.isfinite(target) and target > 0):
            raise ValueError(f"SLO targets must be positive seconds, got {target}")
    best = None
    for point in sorted(points, key=lambda p: p.concurrency):
        if not meets_slo(point, slo_ttft_s, slo_itl_s, percentile):
            break
        best = point
    return best


def find_knee(xs: list[float], ys: list[float], shape: Literal["concave", "convex"] = "concave") -> int | None:
    """Index of the Kneedle knee of an increasing curve, or None (fewer than 3 points, or about straight).

    concave: throughput-like curves that flatten (the knee is where gains start to fade); convex: latency-like
    curves that shoot up (the knee is where they start to climb).
    """
    if len(xs) != len(ys):
        raise ValueError(f"knee: {len(xs)} x values but {len(ys)} y values")
    if shape not in ("concave", "convex"):
        raise ValueError(f"knee shape {shape!r} must be 'concave' or 'convex'")
    if len(xs) < 3:
        return None
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    x = [xs[i] for i in order]
    y = [ys[i] for i in order]
    x_span, y_span = x[-1] - x[0], max(y) - min(y)
    if x_span <= 0 or y_span <= 0:
        return None
    xn = [(v - x[0]) / x_span for v in x]
    yn = [(v - min(y)) / y_span for v in y]
    gaps = [b - a for a, b in zip(xn, yn)] if shape == "concave" else [a - b for a, b in zip(xn, yn)]
    best = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[best] < KNEE_MIN_BEND:
        return None
    return order[best]


@dataclass(frozen=True)
class LittleCheck:
    """Little's law L = lambda x W on one measured point."""

    concurrency: float
    throughput_rps: float
    latency_s: float
    tolerance: float = 2.0

    @property
    def implied_concurrency(self) -> float:
        return self.throughput_rps * self.latency_s

    @property
    def gap(self) -> float:
        """How many times apart the two sides are (>= 1; inf when one side is zero)."""
        a, b = self.concurrency, self.implied_concurrency
        if a <= 0 or b <= 0:
            return math.inf
        return max(a, b) / min(a, b)

    @property
    def ok(self) -> bool:
        return self.gap <= self.tolerance


def littles_law_check(concurrency: float, throughput_rps: float, latency_s: float,
                      tolerance: float = 2.0) -> LittleCheck:
    for name, value in (("concurrency", concurrency), ("throughput", throughput_rps), ("latency", latency_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"Little's law check: {name} must be a finite number >= 0, got {value}")
    if tolerance < 1:
        raise ValueError(f"Little's law tolerance is a factor >= 1, got {tolerance}")
    return LittleCheck(concurrency, throughput_rps, latency_s, tolerance)
