"""The routing policies `--routing-policy` chooses: each places prompts and decodes by its own rule, and the
orchestrator uses the one configured."""

import argparse
import collections
import typing

import pytest

from tandem.cli.args import add_model_options, model_from_options
from tandem.config import RouterConfig
from tandem.metrics import RouterMetrics
from tandem.router.orchestrator import Orchestrator
from tandem.router.policies.base import Placement
from tandem.router.policies.cache_aware import CacheAware
from tandem.router.policies.least_loaded import LeastLoaded
from tandem.router.policies.registry import POLICIES
from tandem.router.policies.round_robin import RoundRobin
from tandem.router.pool import Worker, WorkerPool

URLS = [f"http://worker-{i}.tandem.svc:8000" for i in range(3)]


def make_pool(role: str = "decode") -> WorkerPool:
    pool = WorkerPool(role, None, RouterMetrics("test"))
    for url in URLS:
        pool.workers[url] = Worker(url, healthy=True)
        pool.ring.add(url)
    return pool


def orchestrator_with(policy: str) -> Orchestrator:
    metrics = RouterMetrics("test")
    return Orchestrator(RouterConfig(routing_policy=policy), make_pool("prefill"), make_pool(), None, metrics, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_configured_policy_is_the_one_used(name):
    assert orchestrator_with(name).policy.name == name


def test_cache_aware_is_the_default():
    assert RouterConfig().routing_policy == "cache_aware"
    assert isinstance(orchestrator_with("cache_aware").policy, CacheAware)


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        RouterConfig(routing_policy="random")


def test_round_robin_takes_each_worker_in_turn_whatever_the_key():
    pool, policy = make_pool(), RoundRobin()
    chosen = [policy.place(pool, Placement(key=7, hashes=[], prompt_len=10)) for _ in range(6)]
    assert chosen == URLS + URLS
    assert policy.pick_decode(pool, 1, exclude={URLS[0]}) in URLS[1:]


def test_round_robin_skips_excluded_and_unhealthy_workers_and_answers_none_without_any():
    pool, policy = make_pool(), RoundRobin()
    pool.workers[URLS[1]].healthy = False
    seen = collections.Counter(policy.place(pool, Placement(1, [], 10, exclude={URLS[2]})) for _ in range(4))
    assert seen == {URLS[0]: 4}
    assert policy.pick_decode(pool, 1, exclude=set(URLS)) is None


def test_least_loaded_places_a_prefill_where_the_fewest_prompt_tokens_wait():
    pool, policy = make_pool(), LeastLoaded()
    for url, tokens in zip(URLS, (900, 100, 500), strict=True):
        pool.workers[url].prefill_tokens_in_flight = tokens
    assert policy.place(pool, Placement(1, [], 10)) == URLS[1]
    assert policy.place(pool, Placement(1, [], 10, exclude={URLS[1]})) == URLS[2]


def test_least_loaded_decodes_where_the_fewest_sequences_run():
    pool, policy = make_pool(), LeastLoaded()
    for url, held in zip(URLS, (5, 9, 2), strict=True):
        pool.workers[url].in_flight = held
    assert pool.workers[URLS[2]].sequences_held < pool.workers[URLS[0]].sequences_held
    assert policy.pick_decode(pool, 1, exclude=set()) == URLS[2]
    assert policy.place(pool, Placement(1, [], 10, decodes_here=True)) == URLS[2]
    assert policy.pick_decode(pool, 1, exclude=set(URLS)) is None


def test_cache_aware_keeps_a_key_on_one_worker_where_the_baselines_spread_it():
    spread = {}
    for name, policy in (("cache_aware", orchestrator_with("cache_aware").policy), ("round_robin", RoundRobin())):
        pool = make_pool()
        spread[name] = {policy.place(pool, Placement(key=42, hashes=[], prompt_len=10)) for _ in range(6)}
    assert len(spread["cache_aware"]) == 1 and len(spread["round_robin"]) == 3


def test_every_policy_the_flag_accepts_is_made_by_the_registry():
    field = RouterConfig.model_fields["routing_policy"]
    assert set(typing.get_args(field.annotation)) == set(POLICIES)


def test_the_router_command_takes_the_policy_by_flag_and_refuses_an_unknown_one():
    parser = argparse.ArgumentParser()
    add_model_options(parser, RouterConfig)
    ns = parser.parse_args(["--routing-policy", "least_loaded"])
    assert model_from_options(RouterConfig, ns).routing_policy == "least_loaded"
    with pytest.raises(SystemExit):
        parser.parse_args(["--routing-policy", "random"])
