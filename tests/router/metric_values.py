"""What a router's Prometheus registry holds, read as the tests assert on it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def metric_value(registry: CollectorRegistry, name: str, **labels) -> float:
    """A sample's value summed over the series whose labels include `labels` (0 when there are none)."""
    return sum(s.value for metric in registry.collect() for s in metric.samples
               if s.name == name and labels.items() <= s.labels.items())
