"""The P:D resolver: how many prefill and decode workers a spec asks for."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tandem.operator.crd import RATIO_PATTERN, LLMDeploymentSpec


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int

    @property
    def ratio(self) -> str:
        return f"{self.prefill}:{self.decode}"


def parse_ratio(text: str) -> tuple[int, int]:
    """'1:3' -> (1, 3); anything else is a ValueError that says what a ratio looks like."""
    if not isinstance(text, str) or not re.fullmatch(RATIO_PATTERN, text):
        raise ValueError(f"ratio {text!r} must look like 'P:D' with positive integers, e.g. '1:3'")
    p, d = text.split(":")
    return int(p), int(d)


def split_by_ratio(total: int, ratio: str) -> PoolSizes:
    """Split `total` workers as close to P:D as whole workers allow, keeping at least one of each.

    The prefill share is rounded half up, so 10 workers at 1:3 give 3 prefill : 7 decode (2.5 rounds up);
    status.ratio reports what was actually achieved.
    """
    p, d = parse_ratio(ratio)
    if total < 2:
        raise ValueError(f"replicas {total} cannot hold a prefill and a decode worker: it must be at least 2")
    prefill = math.floor(total * p / (p + d) + 0.5)
    prefill = min(max(prefill, 1), total - 1)
    return PoolSizes(prefill=prefill, decode=total - prefill)


def resolve_pool_sizes(spec: LLMDeploymentSpec) -> PoolSizes:
    if spec.ratio is not None:
        if spec.replicas is None:
            raise ValueError("spec.ratio needs spec.replicas")
        return split_by_ratio(spec.replicas, spec.ratio)
    if spec.prefill.replicas is None or spec.decode.replicas is None:
        raise ValueError("set spec.ratio with spec.replicas, or both prefill.replicas and decode.replicas")
    return PoolSizes(prefill=spec.prefill.replicas, decode=spec.decode.replicas)
