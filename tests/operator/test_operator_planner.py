"""Planner mode: spec.scaling validation, the scraped metrics window, and the real kopf operator resizing the
pools against kmock's emulated API server from metrics a test controls."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

import cel
import pytest
import pytest_asyncio
import yaml
from kube_emulator import CR, EXAMPLE, PDBS, foreign_disruption_budget, running_operator
from pydantic import ValidationError

from tandem.operator.crd import LLMDeploymentSpec
from tandem.operator.crdgen import crd_manifest
from tandem.operator.metrics_source import (
    Sample,
    ScrapedMetrics,
    parse_metrics,
    slice_targets,
    window_from_samples,
)
from tandem.operator.planner import parse_timestamp, timestamp
from tandem.operator.scaling import clamp_to_limits, planned_sizes, planner_limits
from tandem.operator.sizing import PoolSizes
from tandem.operator.validation import SpecError, validate_spec
from tandem.planning.policy import MetricsWindow

DEPLOYMENTS = "apps/v1/deployments"
# One replica's capacity in the fake windows: need_p = rps x in / 800, need_d = rps x out / 80 (at 0.8 util).
PREFILL_TOK_S, DECODE_TOK_S = 1000.0, 100.0
TICK_S = 0.05


def _spec(**scaling) -> dict:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    if scaling:
        spec["scaling"] = scaling
    return spec


def _planner(**overrides) -> dict:
    return {"mode": "planner", "intervalSeconds": TICK_S, "hysteresis": 0.2, "cooldownSeconds": 0,
            "prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 8}, **overrides}


# -- spec.scaling ----------------------------------------------------------------------------------------


def test_scaling_defaults_to_manual_and_planner_limits_follow_the_spec():
    spec, sizes = validate_spec(_spec(), "smollm2")
    assert spec.scaling.mode == "manual"
    assert planned_sizes(spec, sizes, {"planner": {"prefill": 3, "decode": 3}}) == sizes  # manual: the spec rules
    spec, sizes = validate_spec(_spec(**_planner(gpuBudget=6, cooldownSeconds=30)), "smollm2")
    limits = planner_limits(spec)
    assert (limits.min_prefill, limits.max_prefill, limits.min_decode, limits.max_decode) == (1, 4, 1, 8)
    assert (limits.gpu_budget, limits.prefill_gpus_per_replica, limits.decode_gpus_per_replica, limits.hysteresis) == (
        6, 1, 1, 0.2)
    assert (limits.scale_up_cooldown_s, limits.scale_down_cooldown_s) == (30, 30)
    assert planned_sizes(spec, sizes, None) == PoolSizes(1, 3)  # the spec's ratio is the starting point
    assert planned_sizes(spec, sizes, {"planner": {"prefill": 2, "decode": 4}}) == PoolSizes(2, 4)
    # The latest limits always hold, even over an older decision.
    assert planned_sizes(spec, sizes, {"planner": {"prefill": 9, "decode": 9}}) == PoolSizes(2, 4)


def test_clamp_keeps_pools_within_min_max_and_budget():
    spec, _ = validate_spec(_spec(**_planner(gpuBudget=5)), "smollm2")
    limits = planner_limits(spec)
    assert clamp_to_limits(0, 20, limits) == PoolSizes(1, 4)
    assert clamp_to_limits(4, 4, limits) == PoolSizes(3, 2)  # 2.5 rounds half up, as split_by_ratio does
    assert clamp_to_limits(4, 1, limits) == PoolSizes(4, 1)


@pytest.mark.parametrize("scaling, reason", [
    (_planner(prefill={"min": 3, "max": 2}), "a pool's min must not exceed its max"),
    (_planner(gpuBudget=1), "exceed the GPU budget of 1"),
    (_planner(decode={"min": 0, "max": 3}), "spec.scaling.decode.min: must be at least 1"),
    (_planner(mode="auto"), "spec.scaling.mode"),
    (_planner(hysteresis=1.0), "spec.scaling.hysteresis"),
    (_planner(intervalSeconds=0), "spec.scaling.intervalSeconds"),
])
def test_invalid_scaling_gives_reasons_naming_the_field(scaling, reason):
    with pytest.raises(SpecError) as info:
        validate_spec(_spec(**scaling), "smollm2")
    assert reason in str(info.value)


def test_min_above_max_is_refused_by_cel_and_pydantic_alike():
    pool_schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["scaling"]["properties"]["prefill"]
    rules = pool_schema["x-kubernetes-validations"]
    for pool, ok in (({"min": 3, "max": 2}, False), ({"min": 2, "max": 2}, True)):
        assert all(cel.evaluate(rule["rule"], {"self": pool}) for rule in rules) is ok
        if ok:
            LLMDeploymentSpec.model_validate(_spec(**_planner(prefill=pool)))
        else:
            with pytest.raises(ValidationError, match=rules[0]["message"]):
                LLMDeploymentSpec.model_validate(_spec(**_planner(prefill=pool)))


def test_timestamps_round_trip_to_the_millisecond():
    assert parse_timestamp(timestamp(1700000000.123)) == pytest.approx(1700000000.123)
    assert parse_timestamp(None) is None and parse_timestamp("yesterday") is None


# -- the scraped metrics window --------------------------------------------------------------------------

ROUTER_TEXT = """# TYPE tandem_router_requests counter
tandem_router_requests_total{{model="m",pool="router",slo_class="interactive"}} {a}
tandem_router_requests_total{{model="m",pool="router",slo_class="batch"}} {b}
# TYPE tandem_router_failed_requests counter
tandem_router_failed_requests_total{{model="m",pool="router",slo_class="interactive"}} {failed}
# TYPE tandem_router_abandoned_requests counter
tandem_router_abandoned_requests_total{{model="m",pool="router",slo_class="interactive"}} {failed}
# TYPE tandem_router_rejections counter
tandem_router_rejections_total{{model="m",pool="router",slo_class="interactive",reason="slo_unmeetable"}} {refused}
tandem_router_rejections_total{{model="m",pool="router",slo_class="interactive",reason="rate_limited"}} {limited}
tandem_router_rejections_total{{model="m",pool="router",slo_class="interactive",reason="dispatch_slots"}} {limited}
"""


def _router(a, b, failed=0, refused=0, limited=0):
    return parse_metrics(ROUTER_TEXT.format(a=a, b=b, failed=failed, refused=refused, limited=limited))
WORKER_TEXT = """# TYPE tandem_prompt_tokens counter
tandem_prompt_tokens_total{{model="m",pool="{pool}"}} {prompt}
# TYPE tandem_computed_prompt_tokens counter
tandem_computed_prompt_tokens_total{{model="m",pool="{pool}"}} {computed}
# TYPE tandem_generation_tokens counter
tandem_generation_tokens_total{{model="m",pool="{pool}"}} {generated}
# TYPE tandem_num_requests_waiting gauge
tandem_num_requests_waiting{{model="m",pool="{pool}"}} {waiting}
# TYPE tandem_requests_finished counter
tandem_requests_finished_total{{model="m",pool="{pool}",finish_reason="stop"}} {stopped}
tandem_requests_finished_total{{model="m",pool="{pool}",finish_reason="length"}} 1
"""


def _worker(pool, prompt, computed, generated, waiting=0, finished=1):
    return parse_metrics(WORKER_TEXT.format(pool=pool, prompt=prompt, computed=computed, generated=generated,
                                            waiting=waiting, stopped=finished - 1))


def test_window_from_counter_deltas_between_two_scrapes():
    spec = LLMDeploymentSpec.model_validate(_spec(**_planner(prefill={"tokensPerSecond": 5000},
                                                             decode={"tokensPerSecond": 50})))
    before = Sample(at_s=100.0, targets={
        ("router", "10.0.0.1:8000"): _router(10, 0, failed=1, refused=5, limited=100),
        ("prefill", "10.0.1.1:8000"): _worker("prefill", 1000, 900, 10),
        ("decode", "10.0.2.1:8000"): _worker("decode", 1000, 100, 500, finished=10),
        ("decode", "10.0.2.2:8000"): _worker("decode", 50000, 100, 9000, finished=90),
    })
    after = Sample(at_s=110.0, targets={
        # +100 answered, +2 failed, +2 abandoned, +18 refused for capacity; a tenant over its rate, or the router's
        # own dispatch cap, is not demand more workers would serve
        ("router", "10.0.0.1:8000"): _router(60, 50, failed=3, refused=23, limited=900),
        ("prefill", "10.0.1.1:8000"): _worker("prefill", 41000, 40900, 50, waiting=2),  # +40000 computed
        ("prefill", "10.0.1.2:8000"): _worker("prefill", 3000, 3000, 3),  # new pod, ready since: a baseline only
        # +20000 prompt, +10000 out, +80 finished (of requests the router counted before this window, too)
        ("decode", "10.0.2.1:8000"): _worker("decode", 21000, 100, 10500, finished=90),
        # restarted: all of it is new (30000 prompt, 5000 out, 40 finished)
        ("decode", "10.0.2.2:8000"): _worker("decode", 30000, 100, 5000, finished=40),
        ("decode", "10.0.2.3:8000"): _worker("decode", 7000, 100, 7000, finished=30),  # new pod: a baseline only
    })
    window = window_from_samples(before, after, spec)
    assert window.arrival_rps == pytest.approx(12.2)
    # Per request the same pods finished (120, not the router's 100): the new pod's 30 are in neither count.
    assert window.mean_input_tokens == pytest.approx((20000 + 30000) / 120)
    assert window.mean_output_tokens == pytest.approx((10000 + 5000) / 120)
    # Prefill has work waiting: saturated, so its measured 4000 tok/s per pod is its capacity (not the stated
    # 5000), measured on the pod that worked the whole window (the new one is no replica that did nothing).
    # Decode's queue is empty: its throughput (500 per pod) is only the load; the stated 50 holds.
    assert window.prefill_tok_s_per_replica == pytest.approx(4000)
    assert window.decode_tok_s_per_replica == pytest.approx(50)
    assert window.prefill_backlog_tokens == pytest.approx(2 * window.mean_input_tokens)
    assert window_from_samples(after, after, spec) is None

    no_capacity = LLMDeploymentSpec.model_validate(_spec(**_planner()))
    with pytest.raises(ValueError, match="spec.scaling.decode.tokensPerSecond"):
        window_from_samples(before, after, no_capacity)  # decode is not saturated: nothing to plan with
    with pytest.raises(ValueError, match="spec.scaling.prefill.tokensPerSecond"):
        window_from_samples(after, Sample(at_s=120.0, targets=after.targets), no_capacity)


class _FakeKube:
    def __init__(self, slices):
        self.slices = slices

    def list(self, api_version, kind, namespace, labels):
        assert (api_version, kind, namespace) == ("discovery.k8s.io/v1", "EndpointSlice", "ns1")
        return self.slices.get(labels["kubernetes.io/service-name"], [])


def test_scraped_metrics_scrapes_each_ready_pod_and_keeps_the_last_sample():
    slices = {
        "smollm2-router": [{"ports": [{"name": "http", "port": 8000}], "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.9"], "conditions": {"ready": False}}]}],  # not ready: not scraped
        "smollm2-prefill": [{"endpoints": [{"addresses": ["10.0.1.1"]}]}],
        "smollm2-decode": [{"endpoints": [{"addresses": ["10.0.2.1"]}, {"addresses": ["10.0.2.2"]}]}],
    }
    assert slice_targets({"endpoints": [{"addresses": ["fd00::1"]}]}) == ["[fd00::1]:8000"]
    scrapes = {"n": 0}
    times = iter([0.0, 5.0, 10.0])

    def fetch(url, timeout):
        scrapes["n"] += 1
        round_ = (scrapes["n"] - 1) // 4  # rounds of four scrapes: baseline, one pod down, all back
        k = round_ > 0
        if "10.0.0.1" in url:
            return ROUTER_TEXT.format(a=20 if k else 0, b=0, failed=0, refused=0, limited=0)
        if "10.0.2.2" in url:
            if round_ == 1:
                raise OSError("connection refused")
            return WORKER_TEXT.format(pool="decode", prompt=0, computed=0, generated=0, waiting=0, stopped=0)
        if "10.0.1.1" in url:
            return WORKER_TEXT.format(pool="prefill", prompt=0, computed=8000 if k else 0, generated=0, waiting=0,
                                      stopped=0)
        return WORKER_TEXT.format(pool="decode", prompt=4000 if k else 0, computed=0, generated=2000 if k else 0,
                                  waiting=0, stopped=20 if k else 0)  # +20 finished

    source = ScrapedMetrics(_FakeKube(slices), fetch=fetch, clock=lambda: next(times))
    body = {"metadata": {"name": "smollm2", "namespace": "ns1", "uid": "u1"}, "spec": _spec(**_planner(
        prefill={"tokensPerSecond": 1000}, decode={"tokensPerSecond": 100}))}
    assert source(body) is None  # one sample is no window
    # A pod that cannot be read would count no load: no window, so the planner holds its sizes (it sized the
    # pools for no load when a NetworkPolicy kept the operator from every pod).
    assert source(body) is None
    window = source(body)  # all back: the window runs from the last complete sample
    assert scrapes["n"] == 12
    assert (window.arrival_rps, window.mean_input_tokens, window.mean_output_tokens) == (2.0, 200.0, 100.0)
    # No work waits anywhere: the stated capacities hold (the measured throughput is only the load).
    assert (window.prefill_tok_s_per_replica, window.decode_tok_s_per_replica) == (1000.0, 100.0)


# -- the kopf operator in planner mode -------------------------------------------------------------------


class FakeLoad:
    """The metrics source the operator reads in these tests: a load the test sets, with seeded noise."""

    def __init__(self):
        self.rps, self.mean_in, self.mean_out, self.noise = 1.0, 800.0, 240.0, 0.0
        self.random = random.Random(7)
        self.calls = 0

    def set(self, rps=None, mean_in=None, mean_out=None, noise=None):
        self.rps = self.rps if rps is None else rps
        self.mean_in = self.mean_in if mean_in is None else mean_in
        self.mean_out = self.mean_out if mean_out is None else mean_out
        self.noise = self.noise if noise is None else noise

    def __call__(self, body) -> MetricsWindow:
        self.calls += 1
        jitter = 1 + self.random.uniform(-self.noise, self.noise)
        return MetricsWindow(end_s=0.0, arrival_rps=self.rps * jitter, mean_input_tokens=self.mean_in,
                             mean_output_tokens=self.mean_out, prefill_tok_s_per_replica=PREFILL_TOK_S,
                             decode_tok_s_per_replica=DECODE_TOK_S)


@pytest.fixture
def load():
    return FakeLoad()


@pytest_asyncio.fixture
async def planned(emulator, load):
    """The operator (as conftest's `cluster`) with the fake load as its metrics source and a fast tick."""
    logging.getLogger("kopf").setLevel(logging.WARNING)
    async with running_operator(emulator, metrics_source=load, planner_tick_seconds=TICK_S) as running:
        yield running


def _replicas(cluster) -> tuple[int, int] | None:
    p, d = cluster.get(DEPLOYMENTS, "smollm2-prefill"), cluster.get(DEPLOYMENTS, "smollm2-decode")
    return None if p is None or d is None else (p["spec"]["replicas"], d["spec"]["replicas"])


def _planner_status(cluster) -> dict:
    return ((cluster.get(CR, "smollm2") or {}).get("status") or {}).get("planner") or {}


async def _ticks(cluster, load, count: int) -> None:
    """Wait until the planner has read `count` more windows (bounded)."""
    target = load.calls + count
    await cluster.wait_for(f"{count} planner ticks", lambda: load.calls >= target, timeout=count * 1.0 + 5)


async def _apply(cluster, scaling: dict) -> None:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = cluster.namespace
    body["spec"]["scaling"] = scaling
    await cluster.create(CR, body)
    await cluster.wait_for("the pools", lambda: _replicas(cluster))


async def test_a_load_shift_moves_replicas_once_past_the_hysteresis(planned, load):
    cluster = planned
    load.set(rps=1.0, mean_in=800, mean_out=240, noise=0.05)  # needs 1.0 prefill, 3.0 decode: as started
    await _apply(cluster, _planner())
    await _ticks(cluster, load, 4)
    assert _replicas(cluster) == (1, 3)
    assert "decode holds 3" in _planner_status(cluster)["reason"]

    load.set(mean_out=272)  # decode needs 3.4 (3.23..3.57): inside the 2.4..3.6 band, so nothing moves
    await _ticks(cluster, load, 5)
    assert _replicas(cluster) == (1, 3) and cluster.events("Scaled") == []

    load.set(mean_out=360)  # decode needs 4.5 (4.28..4.73 with the noise): past the band, to ceil = 5
    await cluster.wait_for("decode scaled to 5", lambda: _replicas(cluster) == (1, 5))
    status = _planner_status(cluster)
    assert (status["prefill"], status["decode"]) == (1, 5) and "decode 3->5" in status["reason"]
    assert parse_timestamp(status["lastChange"]) is not None
    await _ticks(cluster, load, 8)
    assert _replicas(cluster) == (1, 5)
    scaled = cluster.events("Scaled")
    assert len(scaled) == 1 and scaled[0]["message"].startswith("prefill 1->1, decode 3->5")
    assert _planner_status(cluster)["lastChange"] == status["lastChange"]
    crd_status = cluster.get(CR, "smollm2")["status"]
    assert crd_status["decode"]["desired"] == 5  # the rest of the status follows the planner's sizes

    # A spec change rebuilds the pools from the planner's sizes, not the spec's starting point.
    await cluster.patch(CR, "smollm2", {"spec": {"engine": {"maxNumSeqs": 32}}})
    await cluster.wait_for("the new decode template", lambda: "32" in cluster.get(
        DEPLOYMENTS, "smollm2-decode")["spec"]["template"]["spec"]["containers"][0]["args"])
    await _ticks(cluster, load, 3)
    assert _replicas(cluster) == (1, 5)


async def test_a_resize_that_could_not_be_applied_is_applied_once_it_can_be(planned, load):
    """status.planner holds the new sizes as soon as they are decided, and a later tick sees nothing to change: a
    resize whose apply failed is tried again by the operator's retry timer until it goes through."""
    cluster = planned
    load.set(rps=1.0, mean_in=800, mean_out=240)
    await _apply(cluster, _planner())
    await _ticks(cluster, load, 2)
    assert _replicas(cluster) == (1, 3)
    await cluster.delete(PDBS, "smollm2-router")
    await cluster.create(PDBS, foreign_disruption_budget("smollm2-router", cluster.namespace))
    load.set(mean_out=360)  # decode needs 4.5: to 5, which the foreign PodDisruptionBudget keeps from being applied
    await cluster.wait_for("PlannerFailed", lambda: cluster.events("PlannerFailed"))
    await _ticks(cluster, load, 3)
    assert _replicas(cluster) == (1, 3) and _planner_status(cluster)["decode"] == 5

    await cluster.delete(PDBS, "smollm2-router")
    await cluster.wait_for("decode scaled to 5", lambda: _replicas(cluster) == (1, 5), timeout=15)
    await cluster.wait_for("Degraded cleared", lambda: not any(
        c["type"] == "Degraded" and c["status"] == "True"
        for c in cluster.get(CR, "smollm2")["status"].get("conditions", [])))


async def test_noisy_constant_load_never_changes_replicas_back_and_forth(planned, load):
    cluster = planned
    # Decode needs 3.5 +/- 8% (3.22..3.78): noise crosses the 3.6 edge of the band around 3, so the planner
    # goes to 4 once; around 4 the band is 3.2..4.8 and the same noise never crosses it again.
    load.set(rps=1.0, mean_in=800, mean_out=280, noise=0.08)
    await _apply(cluster, _planner())
    seen = [_replicas(cluster)]
    for _ in range(30):
        await _ticks(cluster, load, 1)
        if _replicas(cluster) != seen[-1]:
            seen.append(_replicas(cluster))
    assert seen in ([(1, 3)], [(1, 3), (1, 4)]), seen
    assert len(cluster.events("Scaled")) == len(seen) - 1 <= 1


async def test_min_max_and_the_gpu_budget_bound_the_pools(planned, load):
    cluster = planned
    load.set(rps=10.0, mean_in=800, mean_out=400)  # needs 10 prefill and 50 decode replicas
    await _apply(cluster, _planner(gpuBudget=10, decode={"min": 2, "max": 8}))
    # Needs scaled by 10/60 to fit the budget (1.67 : 8.33), then decode is capped at its max of 8.
    await cluster.wait_for("2 prefill : 8 decode", lambda: _replicas(cluster) == (2, 8))
    reason = _planner_status(cluster)["reason"]
    assert "10-GPU budget" in reason and "clamped" in reason
    await _ticks(cluster, load, 5)
    assert _replicas(cluster) == (2, 8)

    load.set(rps=0.01)  # almost idle: both pools go down to their minimum, not to zero
    await cluster.wait_for("1 prefill : 2 decode", lambda: _replicas(cluster) == (1, 2))
    await _ticks(cluster, load, 5)
    assert _replicas(cluster) == (1, 2) and len(cluster.events("Scaled")) == 2

    # Tighter limits apply at once, even before the planner's next decision.
    await cluster.patch(CR, "smollm2", {"spec": {"scaling": {"prefill": {"min": 3}, "gpuBudget": 5}}})
    await cluster.wait_for("3 prefill : 2 decode", lambda: _replicas(cluster) == (3, 2))


async def test_manual_mode_ignores_metrics(planned, load):
    cluster = planned
    load.set(rps=10.0, mean_in=800, mean_out=400)
    await _apply(cluster, {"mode": "manual", "intervalSeconds": 0.1, "cooldownSeconds": 0})
    await asyncio.sleep(1.0)  # twenty planner ticks
    assert load.calls == 0
    assert _replicas(cluster) == (1, 3)
    assert cluster.events("Scaled") == [] and _planner_status(cluster) == {}

    # Switching to planner mode hands the pools to the planner, starting from the spec's sizes.
    await cluster.patch(CR, "smollm2", {"spec": {"scaling": {"mode": "planner"}}})
    await cluster.wait_for("the planner scaling up", lambda: _replicas(cluster) != (1, 3))
    assert load.calls > 0


class SlowLoad(FakeLoad):
    """A metrics source with no window at first (one sample), then a read that blocks until released (a slow
    scrape in flight), then the load set."""

    def __init__(self):
        super().__init__()
        self.reading, self.release = threading.Event(), threading.Event()

    def __call__(self, body) -> MetricsWindow | None:
        if self.calls == 0:
            self.calls += 1
            return None
        if self.calls == 1:
            self.reading.set()
            self.release.wait(10)
        return super().__call__(body)


async def test_a_switch_to_manual_during_a_planner_read_is_not_undone(emulator):
    """The planner reads metrics for a resource in planner mode; meanwhile the user switches it to manual and
    its reconcile applies the spec's sizes. The decision from that read is stale and must not be applied."""
    logging.getLogger("kopf").setLevel(logging.WARNING)
    load = SlowLoad()
    load.set(rps=10.0, mean_in=800, mean_out=400)  # a load that would scale the pools up
    async with running_operator(emulator, metrics_source=load, planner_tick_seconds=TICK_S) as cluster:
        await _apply(cluster, {"mode": "planner", "intervalSeconds": 0.05, "cooldownSeconds": 0,
                               "prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 8}})
        assert await asyncio.to_thread(load.reading.wait, 10)
        await cluster.patch(CR, "smollm2", {"spec": {"scaling": {"mode": "manual"}}})
        await cluster.wait_for("the spec's sizes", lambda: _replicas(cluster) == (1, 3))
        load.release.set()
        await asyncio.sleep(1.0)  # the read returns; its decision comes too late
        assert _replicas(cluster) == (1, 3)


def test_what_is_kept_for_a_deleted_llmdeployment_is_dropped():
    """An operator runs for months while LLMDeployments come and go: nothing kept per object outlives it."""
    from tandem.operator.planner import Planner
    from tandem.operator.reconcile import StatusKeeper
    from tandem.operator.status import Problem

    class Gone:  # the API server, once the object is deleted
        def get(self, *_):
            return None

    keeper = StatusKeeper(Gone())
    keeper.note("ns1", "old", Problem(refused=False, message="conflict"), retry_in_s=5)
    with keeper.lock("ns1", "old"):
        pass
    assert keeper.refresh("ns1", "old") is None  # the last status refresh finds it gone, and forgets it...
    assert (keeper._problems, keeper._retry_at) == ({}, {})
    keeper.forget("ns1", "old")  # ...but for the lock it held meanwhile, which its DELETED event finds free
    assert keeper._locks == {}
    with keeper.lock("ns1", "held"):
        keeper.forget("ns1", "held")  # one that is held stays: a second writer must not get a lock of its own
        assert keeper.lock("ns1", "held").locked()
    planner = Planner(Gone(), keeper, source=lambda scraped: None, clock=lambda: 1000.0)
    body = {"metadata": {"uid": "u1", "generation": 1}, "spec": {"scaling": {"mode": "planner"}},
            "status": {"observedGeneration": 1}}
    assert planner.due(body) and not planner.due(body)  # decided once per interval...
    planner.forget("u1")  # ...and deleted (the resource's DELETED event)
    assert planner._last_run == {}
