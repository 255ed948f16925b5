"""The router's garbage-collection settings and the metric that shows their pauses (tandem.router.main)."""

import gc

from prometheus_client import generate_latest

from tandem.metrics import RouterMetrics
from tandem.router.main import gc_pause_recorder


def test_each_collection_is_observed_under_its_generation():
    metrics = RouterMetrics("m")
    record = gc_pause_recorder(metrics)
    gc.callbacks.append(record)
    try:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    finally:
        gc.callbacks.remove(record)
    text = generate_latest(metrics.registry).decode()
    full = [line for line in text.splitlines()
            if line.startswith("tandem_router_gc_pause_seconds_count") and 'generation="2"' in line]
    young = [line for line in text.splitlines()
             if line.startswith("tandem_router_gc_pause_seconds_count") and 'generation="0"' in line]
    assert full and float(full[0].split()[-1]) >= 1
    assert young and float(young[0].split()[-1]) >= 1
