"""SLO classes: the latency targets a request is admitted against."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SLOClass:
    """A named pair of latency targets.

    `ttft_s` sets the request's deadline (arrival + ttft_s) in the earliest-deadline-first queue and is what
    admission checks the predicted wait against. `itl_s` is the inter-token target the router judges
    goodput by. `priority` breaks ties between equal deadlines, higher first.
    """

    name: str
    ttft_s: float
    itl_s: float
    priority: int = 0

    def __post_init__(self):
        if not self.name:
            raise ValueError("an SLO class needs a name")
        for field in ("ttft_s", "itl_s"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SLO class {self.name!r}: {field} must be a positive number of seconds, got {value}")


INTERACTIVE = SLOClass("interactive", ttft_s=1.0, itl_s=0.1, priority=1)
BATCH = SLOClass("batch", ttft_s=30.0, itl_s=1.0, priority=0)
DEFAULT_SLO_CLASSES: dict[str, SLOClass] = {c.name: c for c in (INTERACTIVE, BATCH)}
