"""Where the workers are: a static list, or Kubernetes EndpointSlices selected by label."""

from __future__ import annotations

import asyncio

from tandem.config import RouterConfig


class StaticDiscovery:
    def __init__(self, prefill: list[str], decode: list[str]):
        self._members = (list(prefill), list(decode))

    async def members(self) -> tuple[list[str], list[str]]:
        return self._members


class KubernetesDiscovery:
    """Lists the EndpointSlices of each pool's headless Service (by the pool's label selector) and
    returns the ready endpoints as URLs. Called every probe interval, so it follows scale-ups,
    rollouts and dead pods without a watch connection to keep alive."""

    def __init__(self, namespace: str, prefill_selector: str, decode_selector: str):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api = client.DiscoveryV1Api()
        self.namespace = namespace
        self.selectors = (prefill_selector, decode_selector)

    def _urls(self, selector: str) -> list[str]:
        urls = []
        for eps in self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector).items:
            port = next((p.port for p in eps.ports or [] if p.name in (None, "http")), None)
            for ep in eps.endpoints or []:
                if port and (ep.conditions is None or ep.conditions.ready is not False):
                    urls += [f"http://{addr}:{port}" for addr in ep.addresses]
        return sorted(set(urls))

    async def members(self) -> tuple[list[str], list[str]]:
        return await asyncio.to_thread(lambda: (self._urls(self.selectors[0]), self._urls(self.selectors[1])))


def make_discovery(config: RouterConfig):
    if config.discovery == "kubernetes":
        if not (config.namespace and config.prefill_selector and config.decode_selector):
            raise SystemExit("--discovery kubernetes needs --namespace, --prefill-selector and --decode-selector")
        return KubernetesDiscovery(config.namespace, config.prefill_selector, config.decode_selector)
    if not config.decode:
        raise SystemExit("the router needs at least one --decode URL (static discovery)")
    return StaticDiscovery(config.prefill, config.decode)
