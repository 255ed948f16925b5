"""KubernetesDiscovery against an emulated API server (kmock): each pool's label selector picks its
EndpointSlices, ready endpoints become worker URLs, and a worker that leaves discovery leaves the ring.

The emulated workers listen on 127.0.0.2 and 127.0.0.3 (loopback), so the pool's real health probes run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import attrs
import httpx
import kmock
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from kubernetes.config import kube_config

from tandem.metrics import RouterMetrics
from tandem.router.discovery import KubernetesDiscovery
from tandem.router.pool import WorkerPool, probe_pools
from tandem.runtimes.launcher import free_port

SLICES = "discovery.k8s.io/v1/endpointslices"
NAMESPACE = "serving"
PREFILL_SELECTOR = "app.kubernetes.io/name=tandem,tandem.dev/role=prefill"
DECODE_SELECTOR = "app.kubernetes.io/name=tandem,tandem.dev/role=decode"


def parse_selector(selector: str) -> dict[str, str]:
    """Equality-based label selectors only ("k=v,k2=v2"): anything else fails loudly, never matches silently."""
    wanted = {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep or value.startswith("=") or key.endswith("!"):
            raise ValueError(f"this emulator supports only k=v selector terms, got {term!r}")
        wanted[key.strip()] = value.strip()
    return wanted


@attrs.define(kw_only=True)
class SelectingEmulator(kmock.KubernetesEmulator):
    """kmock lists every object of a resource; a real API server honours ?labelSelector= on lists."""

    async def _serve_list(self, request):
        listing = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = parse_selector(selector)
            listing["items"] = [obj for obj in listing["items"]
                                if wanted.items() <= obj.get("metadata", {}).get("labels", {}).items()]
        return listing


def endpoint_slice(name: str, role: str, port: int, endpoints: list[tuple[str, bool | None]],
                   port_name: str | None = "http", extra_ports: tuple[dict, ...] = ()) -> dict:
    """An EndpointSlice as the controller writes it; ready None leaves `conditions.ready` unset (unknown)."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "tandem", "tandem.dev/role": role,
                                "kubernetes.io/service-name": f"tandem-{role}"}},
        "addressType": "IPv4",
        "ports": [*extra_ports, {"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {} if ready is None else {"ready": ready}}
                      for address, ready in endpoints],
    }


def slices_path(name: str | None = None) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices" + (f"/{name}" if name else "")


@pytest_asyncio.fixture
async def emulator():
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    async with SelectingEmulator() as server, kmock.Server(server):
        server.resources[SLICES] = kmock.ResourceInfo(kind="EndpointSlice", namespaced=True,
                                                      verbs={"get", "list", "watch", "create", "patch", "update",
                                                             "delete"})
        yield server


def point_kubeconfig_at(server: str, tmp_path, monkeypatch) -> None:
    """Not in a pod: KubernetesDiscovery falls back to the default kubeconfig, here one that names `server`."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {"token": "test"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
    }))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


@pytest.fixture
def discovery(emulator, tmp_path, monkeypatch):
    """KubernetesDiscovery as deployed, but configured from a kubeconfig that points at the emulator."""
    point_kubeconfig_at(str(emulator.url).rstrip("/"), tmp_path, monkeypatch)
    return KubernetesDiscovery(NAMESPACE, PREFILL_SELECTOR, DECODE_SELECTOR)


async def create(emulator, body: dict) -> None:
    response = await emulator.post(slices_path(), json=body)
    assert response.status in (200, 201), await response.text()


async def delete(emulator, name: str) -> None:
    response = await emulator.delete(slices_path(name))
    assert response.status == 200, await response.text()


async def test_each_selector_yields_its_ready_endpoints(emulator, discovery):
    await create(emulator, endpoint_slice("prefill-a", "prefill", 8000, [
        ("10.1.0.1", True), ("10.1.0.2", False), ("10.1.0.3", None)]))
    await create(emulator, endpoint_slice("decode-a", "decode", 8001, [("10.2.0.1", True), ("10.2.0.2", False)],
                                          extra_ports=({"name": "metrics", "port": 9090, "protocol": "TCP"},)))
    await create(emulator, endpoint_slice("decode-b", "decode", 8001, [("10.2.0.3", True)]))
    await create(emulator, endpoint_slice("other", "router", 8002, [("10.3.0.1", True)]))

    prefill, decode = await discovery.members()

    # Not ready: left out. Unknown readiness (no condition): counted ready, as the EndpointSlice API advises.
    assert prefill == ["http://10.1.0.1:8000", "http://10.1.0.3:8000"]
    # Across both slices of the pool, on the http port rather than the metrics port; never another pool's.
    assert decode == ["http://10.2.0.1:8001", "http://10.2.0.3:8001"]


async def test_no_slices_means_empty_pools(emulator, discovery):
    assert await discovery.members() == ([], [])


async def test_an_api_server_away_is_said_once_and_asked_again_with_backoff(tmp_path, monkeypatch, caplog):
    """While the API server is away the router keeps the workers it listed last, logs one line (no traceback, no
    urllib3 retry warnings) and asks again ever less often; one more line when the API server is back."""
    port = free_port()
    slices = [endpoint_slice("decode-a", "decode", 8001, [("10.2.0.1", True)])]

    async def list_slices(request):  # the API server's answer, labelSelector honoured
        wanted = parse_selector(request.query["labelSelector"]).items()
        items = [s for s in slices if wanted <= s["metadata"]["labels"].items()]
        return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                  "metadata": {}, "items": items})

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.add_routes([web.get(slices_path(), list_slices)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await serve()
    try:
        point_kubeconfig_at(f"http://127.0.0.1:{port}", tmp_path, monkeypatch)
        discovery = KubernetesDiscovery(NAMESPACE, PREFILL_SELECTOR, DECODE_SELECTOR, backoff_s=0.1,
                                        max_backoff_s=0.4)
        listed = ([], ["http://10.2.0.1:8001"])
        assert await discovery.members() == listed
        tries = []
        list_slices_of = discovery.api.list_namespaced_endpoint_slice
        monkeypatch.setattr(discovery.api, "list_namespaced_endpoint_slice",
                            lambda *args, **kwargs: tries.append(1) or list_slices_of(*args, **kwargs))

        await runner.cleanup()  # away: its connections closed, its port refusing
        caplog.clear()
        caplog.set_level(logging.INFO)
        for _ in range(30):  # the router asks every probe interval
            assert await discovery.members() == listed  # the workers listed last stay
            await asyncio.sleep(0.05)
        # 30 asks in 1.5 s; backoff 0.1, 0.2, 0.4, 0.4, ... s lets through about 6.
        assert 3 <= len(tries) <= 8, tries
        said = [r for r in caplog.records if r.name == "tandem.router.discovery"]
        assert [r.levelno for r in said] == [logging.WARNING] and said[0].exc_info is None
        assert "listing EndpointSlices in serving failed" in said[0].getMessage()
        assert "keeping the 1 workers listed last" in said[0].getMessage()
        assert not [r for r in caplog.records if r.name.startswith("urllib3")]

        runner = await serve()
        slices.append(endpoint_slice("prefill-a", "prefill", 8000, [("10.1.0.1", True)]))
        await asyncio.sleep(0.45)  # past the longest backoff
        assert await discovery.members() == (["http://10.1.0.1:8000"], ["http://10.2.0.1:8001"])
        said = [r for r in caplog.records if r.name == "tandem.router.discovery"]
        assert [r.levelno for r in said] == [logging.WARNING, logging.INFO]
        assert "listed again" in said[1].getMessage()
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def fake_workers(hosts: list[str], port: int, max_model_len: int = 2048, role: str = "decode"):
    """Workers that pass the pool's probes (/internal/load and /ready) on host:port each."""
    async def load(_):
        return web.json_response({"role": role, "free_blocks": 100, "total_blocks": 100, "running": 0,
                                  "waiting": 0, "in_flight": 0, "max_model_len": max_model_len})

    async def ready(_):
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.add_routes([web.get("/internal/load", load), web.get("/ready", ready)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        for host in hosts:
            await web.TCPSite(runner, host, port).start()
        yield
    finally:
        await runner.cleanup()


async def test_a_worker_that_leaves_discovery_leaves_the_ring(emulator, discovery):
    port = free_port()
    a, b = "127.0.0.2", "127.0.0.3"
    url_a, url_b = f"http://{a}:{port}", f"http://{b}:{port}"
    async with fake_workers([a, b], port), httpx.AsyncClient() as http:
        pool = WorkerPool("decode", http, RouterMetrics("test"))

        async def refresh() -> None:  # what the router's probe loop does for one pool, each interval
            _, decode = await discovery.members()
            pool.set_members(decode)
            await probe_pools([pool])

        await create(emulator, endpoint_slice("decode-a", "decode", port, [(a, True), (b, True)]))
        await refresh()
        assert pool.ring.workers == tuple(sorted([url_a, url_b]))
        key_owned_by_a = next(k for k in range(0, 1 << 64, (1 << 64) // 4096) if pool.ring.owner(k) == url_a)

        # The pod behind b is terminating: its endpoint turns not ready. It must leave rotation at once,
        # although it still answers its probes.
        await delete(emulator, "decode-a")
        await create(emulator, endpoint_slice("decode-a", "decode", port, [(a, True), (b, False)]))
        await refresh()
        assert pool.ring.workers == (url_a,)
        assert set(pool.workers) == {url_a}
        assert pool.ring.owner(key_owned_by_a) == url_a  # a's keys stay where they were

        # The whole slice goes away (service scaled to zero): the pool empties.
        await delete(emulator, "decode-a")
        await refresh()
        assert pool.ring.workers == () and pool.workers == {}

        # A new pod joins: discovered, probed ready, back in the ring.
        await create(emulator, endpoint_slice("decode-b", "decode", port, [(b, True)]))
        await refresh()
        assert pool.ring.workers == (url_b,)


async def test_the_router_serves_the_least_context_of_its_workers():
    """A request may meet any worker in rotation (its prefill one, its decode one, another after a failure): the
    router's context limit is the least they report (a worker's is less than its model's when its KV cache holds
    less)."""
    from tandem.config import RouterConfig
    from tandem.router.main import Router

    prefill_port, decode_port = free_port(), free_port()
    async with fake_workers(["127.0.0.1"], prefill_port, 1024, "prefill"), \
            fake_workers(["127.0.0.1"], decode_port, 4096):
        router = Router(RouterConfig(prefill=[f"http://127.0.0.1:{prefill_port}"],
                                     decode=[f"http://127.0.0.1:{decode_port}"]))
        try:
            await router.refresh()
            assert router.max_model_len == 1024
        finally:
            await router.http.aclose()
            await router.worker_client.close()


async def test_a_worker_in_the_wrong_pool_stays_out_of_rotation(caplog):
    """A decode worker listed among the prefill workers would refuse every prefill sent to it (400, which the
    client would get): the probe reads its role and keeps it out, and says why once. A "both" worker serves
    either pool."""
    decode_port, both_port = free_port(), free_port()
    async with fake_workers(["127.0.0.1"], decode_port), fake_workers(["127.0.0.1"], both_port, role="both"), \
            httpx.AsyncClient() as http:
        pool = WorkerPool("prefill", http, RouterMetrics("test"))
        misplaced, both = f"http://127.0.0.1:{decode_port}", f"http://127.0.0.1:{both_port}"
        pool.set_members([misplaced, both])
        for _ in range(2):
            await probe_pools([pool])
        assert [w.url for w in pool.healthy()] == [both]
        assert caplog.text.count(f"{misplaced} is a decode worker, listed among the prefill workers") == 1
