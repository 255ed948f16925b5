"""The routing policies `--routing-policy` names, and how each is made."""

from __future__ import annotations

from tandem.config import RouterConfig
from tandem.metrics import RouterMetrics
from tandem.router.policies.base import RoutingPolicy
from tandem.router.policies.cache_aware import CacheAware
from tandem.router.policies.least_loaded import LeastLoaded
from tandem.router.policies.round_robin import RoundRobin
from tandem.router.prefix_predictor import PrefixPredictor

POLICIES = {
    "cache_aware": lambda config, predictor, metrics: CacheAware(config, predictor, metrics),
    "round_robin": lambda config, predictor, metrics: RoundRobin(),
    "least_loaded": lambda config, predictor, metrics: LeastLoaded(),
}


def make_policy(config: RouterConfig, predictor: PrefixPredictor, metrics: RouterMetrics) -> RoutingPolicy:
    """The policy `config.routing_policy` names."""
    return POLICIES[config.routing_policy](config, predictor, metrics)
