"""Where the workers are: a static list, or Kubernetes EndpointSlices selected by label."""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.config import RouterConfig

log = logging.getLogger("tandem.router.discovery")
MAX_BACKOFF_S = 30.0


class StaticDiscovery:
    def __init__(self, prefill: list[str], decode: list[str]):
        self._members = (list(prefill), list(decode))

    async def members(self) -> tuple[list[str], list[str]]:
        return self._members


class KubernetesDiscovery:
    """Lists the EndpointSlices of each pool's headless Service (by the pool's label selector) and
    returns the ready endpoints as URLs. Called every probe interval, so it follows scale-ups,
    rollouts and dead pods without a watch connection to keep alive. While the API server does not
    answer, the workers last listed stay, and it is asked again after `backoff_s`, twice that, and so
    on up to `max_backoff_s`."""

    def __init__(self, namespace: str, prefill_selector: str, decode_selector: str, backoff_s: float = 1.0,
                 max_backoff_s: float = MAX_BACKOFF_S, timeout_s: float = 10.0):
        from kubernetes import client, config
        from urllib3.exceptions import HTTPError

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        configuration.retries = 0  # urllib3 would retry three times, a warning each: the backoff spaces the tries
        self.api = client.DiscoveryV1Api(client.ApiClient(configuration))
        self.namespace = namespace
        self.selectors = (prefill_selector, decode_selector)
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self._members: tuple[list[str], list[str]] = ([], [])
        self._failures = 0  # in a row
        self._next_try = 0.0  # time.monotonic()
        self._unreachable = (client.ApiException, HTTPError, OSError)  # what a failed listing raises

    def _urls(self, selector: str) -> list[str]:
        urls = []
        slices = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                         _request_timeout=self.timeout_s)
        for eps in slices.items:
            port = next((p.port for p in eps.ports or [] if p.name in (None, "http")), None)
            for ep in eps.endpoints or []:
                if port and (ep.conditions is None or ep.conditions.ready is not False):
                    urls += [f"http://{addr}:{port}" for addr in ep.addresses]
        return sorted(set(urls))

    async def members(self) -> tuple[list[str], list[str]]:
        if time.monotonic() < self._next_try:
            return self._members
        try:
            self._members = await asyncio.to_thread(lambda: (self._urls(self.selectors[0]), self._urls(self.selectors[1])))
        except self._unreachable as exc:
            self._failed(exc)
        else:
            self._listed()
        return self._members

    def _failed(self, exc: Exception) -> None:
        """One line when listing starts failing, not one per try."""
        self._failures += 1
        self._next_try = time.monotonic() + min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)
        if self._failures == 1:
            known = sum(len(urls) for urls in self._members)
            log.warning("kubernetes discovery: listing EndpointSlices in %s failed (%s); keeping the %d workers "
                        "listed last, asking again with backoff up to %.0f s", self.namespace, _reason(exc), known,
                        self.max_backoff_s)

    def _listed(self) -> None:
        if self._failures:
            log.info("kubernetes discovery: EndpointSlices in %s listed again, after %d failed tries", self.namespace,
                     self._failures)
        self._failures, self._next_try = 0, 0.0


def _reason(exc: Exception) -> str:
    """One line for a failed listing: the HTTP status, or what broke the connection."""
    status = getattr(exc, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '')}".strip()
    cause = getattr(exc, "reason", None) or exc  # urllib3's MaxRetryError carries what broke
    return f"{type(cause).__name__}: {cause}"[:300]


def make_discovery(config: RouterConfig):
    if config.discovery == "kubernetes":
        if not (config.namespace and config.prefill_selector and config.decode_selector):
            raise SystemExit("--discovery kubernetes needs --namespace, --prefill-selector and --decode-selector")
        return KubernetesDiscovery(config.namespace, config.prefill_selector, config.decode_selector)
    if not config.decode:
        raise SystemExit("the router needs at least one --decode URL (static discovery)")
    return StaticDiscovery(config.prefill, config.decode)
